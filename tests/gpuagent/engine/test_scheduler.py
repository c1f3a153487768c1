import random

import pytest

from gpuagent.engine.cache import BlockManager
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.scheduler import (
    RequestTooLargeError,
    Scheduler,
    Sequence,
    SequenceStatus,
)


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    prompt = [(i * 7 + len(request_id)) % 250 for i in range(prompt_len)]
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def fake_token(seq: Sequence) -> int:
    # Depends only on the sequence's tokens so recomputation yields the same stream.
    return (sum(seq.all_token_ids) * 31 + seq.num_tokens) % 250


def run_step(scheduler: Scheduler):
    out = scheduler.schedule()
    for chunk in out.chunks:
        # Every scheduled token must have a slot in blocks the sequence holds.
        table = scheduler.blocks.block_table(chunk.seq.request_id)
        assert len(table) * scheduler.blocks.block_size >= chunk.end
    sampled = {c.seq.request_id: fake_token(c.seq) for c in out.chunks if c.samples}
    scheduler.commit(out, sampled)
    for seq in list(scheduler.running):
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            scheduler.finish(seq, "length")
    return out


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    for step in range(max_steps):
        if not scheduler.has_unfinished():
            return step
        out = run_step(scheduler)
        assert not out.is_empty, "scheduler stalled with work left"
    raise AssertionError("did not finish")


def test_it_lets_new_requests_join_while_others_decode():
    scheduler = Scheduler(BlockManager(64, 4), max_num_batched_tokens=64)
    a = make_seq("a", 5, max_tokens=10)
    scheduler.add(a)
    run_step(scheduler)  # a's prefill
    run_step(scheduler)  # a decodes alone

    b = make_seq("b", 6)
    scheduler.add(b)
    out = run_step(scheduler)

    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [
        ("a", 1),
        ("b", 6),
    ]
    assert all(c.samples for c in out.chunks)


def test_it_chunks_a_long_prompt_under_the_token_budget():
    scheduler = Scheduler(BlockManager(64, 4), max_num_batched_tokens=16)
    seq = make_seq("long", 50)
    scheduler.add(seq)

    chunks = [run_step(scheduler).chunks[0] for _ in range(4)]

    assert [(c.start, c.num_tokens) for c in chunks] == [
        (0, 16),
        (16, 16),
        (32, 16),
        (48, 2),
    ]
    assert [c.samples for c in chunks] == [False, False, False, True]
    assert len(seq.output_token_ids) == 1


def test_it_batches_decodes_of_all_running_sequences_in_one_step():
    scheduler = Scheduler(BlockManager(64, 4), max_num_batched_tokens=64)
    for name in "abc":
        scheduler.add(make_seq(name, 3, max_tokens=8))
    run_step(scheduler)

    out = run_step(scheduler)

    assert sorted(c.seq.request_id for c in out.chunks) == ["a", "b", "c"]
    assert out.num_batched_tokens == 3


def test_it_runs_no_more_than_max_num_seqs_at_once():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2)
    for name in "abcd":
        scheduler.add(make_seq(name, 3))

    run_step(scheduler)

    assert len(scheduler.running) == 2
    assert [s.request_id for s in scheduler.waiting] == ["c", "d"]


def test_it_preempts_the_newest_sequence_when_blocks_run_out():
    # 4 blocks of 4 tokens; a and b take 2 blocks each for 8-token prompts and both
    # need a third block for their first generated token.
    scheduler = Scheduler(BlockManager(4, 4), max_num_batched_tokens=64)
    a, b = make_seq("a", 8, max_tokens=4), make_seq("b", 8, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)

    out = run_step(scheduler)

    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.output_token_ids != []  # kept, to be recomputed
    assert scheduler.waiting[0] is b
    assert scheduler.blocks.block_table("b") == []
    assert scheduler.num_preemptions == 1


def test_it_recomputes_a_preempted_sequence_to_the_same_tokens():
    def outputs(num_blocks):
        scheduler = Scheduler(BlockManager(num_blocks, 4), max_num_batched_tokens=32)
        seqs = [make_seq(f"s{i}", 5 + 3 * i, max_tokens=9) for i in range(4)]
        for seq in seqs:
            scheduler.add(seq)
        run_to_completion(scheduler)
        return [s.output_token_ids for s in seqs], scheduler.num_preemptions

    roomy, roomy_preemptions = outputs(num_blocks=64)
    tight, tight_preemptions = outputs(num_blocks=7)

    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    assert tight == roomy


def test_it_finishes_every_request_under_a_tiny_pool_without_leaking_blocks():
    rng = random.Random(1234)
    blocks = BlockManager(10, 4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=12)
    seqs = [
        make_seq(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12))
        for i in range(30)
    ]
    for seq in seqs[:10]:
        scheduler.add(seq)

    for seq in seqs[10:]:  # the rest arrive while others run
        run_step(scheduler)
        scheduler.add(seq)
    run_to_completion(scheduler)

    assert all(s.finished for s in seqs)
    assert [len(s.output_token_ids) for s in seqs] == [
        s.params.max_tokens for s in seqs
    ]
    assert blocks.num_free_blocks == blocks.num_blocks
    assert scheduler.sequences == {}


def test_it_rejects_a_request_that_could_never_fit_the_pool():
    scheduler = Scheduler(BlockManager(4, 4))

    with pytest.raises(RequestTooLargeError, match="only 4 blocks"):
        scheduler.add(make_seq("big", 14, max_tokens=3))

    assert not scheduler.has_unfinished()


def test_it_rejects_a_request_longer_than_the_context():
    scheduler = Scheduler(BlockManager(64, 4), max_model_len=32)

    with pytest.raises(RequestTooLargeError, match="maximum context length is 32"):
        scheduler.add(make_seq("big", 30, max_tokens=3))


def test_it_serves_a_request_that_needs_the_whole_pool():
    scheduler = Scheduler(BlockManager(4, 4), max_num_batched_tokens=8)
    seq = make_seq("whole", 13, max_tokens=3)
    scheduler.add(seq)
    scheduler.add(make_seq("other", 2, max_tokens=2))

    run_to_completion(scheduler)

    assert seq.output_token_ids and len(seq.output_token_ids) == 3


def test_it_frees_blocks_at_once_when_a_running_request_is_aborted():
    blocks = BlockManager(16, 4)
    scheduler = Scheduler(blocks)
    scheduler.add(make_seq("a", 10, max_tokens=8))
    scheduler.add(make_seq("b", 3, max_tokens=8))
    run_step(scheduler)

    aborted = scheduler.abort("a")

    assert aborted.finish_reason == "abort" and aborted.finished
    assert blocks.block_table("a") == []
    assert blocks.num_used_blocks == len(blocks.block_table("b")) == 1
    assert [s.request_id for s in scheduler.running] == ["b"]


def test_it_aborts_a_waiting_request_and_ignores_unknown_ids():
    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=1)
    scheduler.add(make_seq("a", 3))
    scheduler.add(make_seq("b", 3))
    run_step(scheduler)

    assert scheduler.abort("b").finish_reason == "abort"
    assert scheduler.abort("nope") is None
    assert list(scheduler.waiting) == []


def test_it_refuses_a_duplicate_request_id():
    scheduler = Scheduler(BlockManager(16, 4))
    scheduler.add(make_seq("a", 3))

    with pytest.raises(ValueError, match="already in use"):
        scheduler.add(make_seq("a", 3))


# -- prefix cache ----------------------------------------------------------------------


def caching_scheduler(num_blocks: int, refill: int = 0, **kwargs) -> Scheduler:
    blocks = BlockManager(num_blocks, 4)
    blocks.enable_prefix_caching(b"root", refill)
    return Scheduler(blocks, **kwargs)


def with_prompt(request_id: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def test_it_starts_a_request_after_its_cached_prefix():
    scheduler = caching_scheduler(32, max_num_batched_tokens=64)
    shared = list(range(30, 40))
    scheduler.add(with_prompt("a", shared))
    run_to_completion(scheduler)
    b = with_prompt("b", shared[:9] + [1, 2, 3])
    scheduler.add(b)

    out = run_step(scheduler)

    assert [(c.start, c.num_tokens) for c in out.chunks] == [(8, 4)]
    assert b.num_cached_tokens == 8
    assert scheduler.prefix_cache_queries == 10 + 12
    assert scheduler.prefix_cache_hits == 8


def test_it_refills_a_window_from_before_the_cached_prefix():
    scheduler = caching_scheduler(32, refill=6, max_num_batched_tokens=64)
    shared = list(range(30, 43))
    scheduler.add(with_prompt("a", shared))
    run_to_completion(scheduler)
    b = with_prompt("b", shared + [1])

    scheduler.add(b)
    out = run_step(scheduler)

    # 12 tokens cached in 3 blocks; the 6 before their end are computed again
    assert [(c.start, c.end) for c in out.chunks] == [(6, 14)]
    assert b.num_cached_tokens == 6
    assert scheduler.blocks.slot_mapping("b", 6, 14)[:6] == [-1] * 6


def test_it_skips_the_cache_for_a_request_that_asks_for_prompt_logprobs():
    scheduler = caching_scheduler(32, max_num_batched_tokens=64)
    shared = list(range(30, 40))
    scheduler.add(with_prompt("a", shared))
    run_to_completion(scheduler)
    b = Sequence("b", shared, SamplingParams(max_tokens=1, prompt_logprobs=0))

    scheduler.add(b)
    out = run_step(scheduler)

    assert out.chunks[0].start == 0 and b.num_cached_tokens == 0


def test_it_preempts_a_sequence_that_shares_blocks_and_hits_the_cache_again():
    shared = [(i * 7) % 250 for i in range(16)]

    def serve(scheduler):
        seqs = [with_prompt(f"s{i}", shared + [i] * (i + 1), 10) for i in range(4)]
        scheduler.add(seqs[0])
        run_step(scheduler)  # the shared prefix is cached after this step
        for seq in seqs[1:]:
            scheduler.add(seq)
        resumed_at = []  # where each readmission after a preemption starts
        while scheduler.has_unfinished():
            before = {s.request_id: s.num_preemptions for s in scheduler.waiting}
            for chunk in run_step(scheduler).chunks:
                if before.get(chunk.seq.request_id):
                    resumed_at.append(chunk.start)
        return [s.output_token_ids for s in seqs], resumed_at

    roomy, _ = serve(Scheduler(BlockManager(64, 4), max_num_batched_tokens=32))
    tight_scheduler = caching_scheduler(12, max_num_batched_tokens=32)

    tight, resumed_at = serve(tight_scheduler)

    assert tight_scheduler.num_preemptions > 0
    assert tight == roomy
    # every readmission started from the shared prefix at least (the others held
    # it while the preempted sequence waited), and the pool is whole again
    assert resumed_at and all(start >= len(shared) for start in resumed_at)
    assert tight_scheduler.blocks.num_used_blocks == 0
