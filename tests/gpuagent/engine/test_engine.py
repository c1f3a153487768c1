import asyncio

import pytest
import torch

from gpuagent.engine.engine import AsyncLLMEngine, LLMEngine, prepare_inputs
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.scheduler import RequestTooLargeError

PROMPTS = [
    "hello world",
    "안녕하세요, 반갑습니다",
    "def add(a, b):\n    return",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 2,
    "import os\nimport sys\n",
]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def greedy_alone(engine: LLMEngine, prompts, params=GREEDY):
    return [engine.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize(
    "kv_dtype", ["bf16", "fp16", "fp8", "fp8-per-token", "int8", "int4", "int4c"]
)
def test_it_generates_with_every_kv_dtype(
    make_engine, tiny_model_and_tokenizer, kv_dtype
):
    # Plumbing on the random tiny model; how close each cache stays to the exact
    # forward pass is checked on the trained demo model (test_demo_model.py).
    model, _ = tiny_model_and_tokenizer
    engine = make_engine(kv_cache_dtype=kv_dtype)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)

    outs = engine.generate(PROMPTS[:3], params)

    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == 6
        assert all(0 <= t < model.config.vocab_size for t in out.token_ids)
        assert all(-30 < lp.logprob <= 0 for lp in out.logprobs)
    assert engine.kv.blocks.num_used_blocks == 0


def test_it_keeps_the_newest_tokens_of_int4_sequences_in_a_bf16_window(make_engine):
    engine = make_engine(kv_cache_dtype="int4", max_num_seqs=5)

    assert engine.kv.window == 18 and engine.kv.blocks.num_windows == 5
    assert make_engine(kv_cache_dtype="int8").kv.window == 0
    assert make_engine(kv_cache_dtype="int4", kv_window=0).kv.window == 0
    assert engine.metrics.registry.get_sample_value("engine_kv_window_tokens") == 18


def test_a_window_over_the_whole_context_reproduces_bf16_kv_exactly(make_engine):
    # Every position read from the bf16 window: int4 blocks never reach a dot, so
    # the tokens must equal bf16-KV's bit for bit, through batching, chunked
    # prefill and preemption (a recomputed sequence gets another row). The int4
    # layout is rotated (Hadamard basis), so the bf16 cache it is held to is too.
    bf16_engine = make_engine(kv_cache_dtype="bf16")
    for cache in bf16_engine.kv.kv_caches:
        cache.rotated = True
    bf16 = greedy_alone(bf16_engine, PROMPTS)
    engine = make_engine(
        kv_cache_dtype="int4",
        kv_window=256,  # the tiny model's max_position_embeddings
        num_blocks=30,
        max_num_batched_tokens=32,
    )

    outs = engine.generate(PROMPTS, GREEDY)

    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == bf16
    assert engine.kv.blocks.window_rows == {}


def test_it_gives_the_same_int4_window_tokens_batched_as_alone(make_engine):
    # Each sequence reads only its own window row.
    alone = greedy_alone(make_engine(kv_cache_dtype="int4", kv_window=4), PROMPTS)

    batched = make_engine(kv_cache_dtype="int4", kv_window=4).generate(PROMPTS, GREEDY)

    assert [o.token_ids for o in batched] == alone


def test_it_matches_a_cache_free_greedy_decode(make_engine, tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    engine = make_engine(kv_cache_dtype="fp16")
    prompt = PROMPTS[2]

    out = engine.generate([prompt], GREEDY)[0]

    ids = engine.encode_prompt(prompt)
    for _ in range(GREEDY.max_tokens):
        ids.append(int(model.forward_dense(torch.tensor([ids]))[0, -1].argmax()))
    assert out.token_ids == ids[-GREEDY.max_tokens :]


def test_it_gives_the_same_greedy_tokens_batched_as_alone(make_engine):
    alone = greedy_alone(make_engine(), PROMPTS)
    engine = make_engine()

    # Half arrive at once, the rest join while the first half decodes.
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outputs = {}
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id] = out
    for i, prompt in enumerate(PROMPTS[3:], start=3):
        engine.add_request(f"r{i}", prompt, GREEDY)
    batch_sizes = []
    while engine.has_unfinished_requests():
        batch_sizes.append(len(engine.scheduler.running))
        for out in engine.step():
            outputs[out.request_id] = out

    assert max(batch_sizes) == len(PROMPTS)
    assert [outputs[f"r{i}"].token_ids for i in range(len(PROMPTS))] == alone


def test_it_gives_the_same_greedy_output_when_preempting(make_engine):
    alone = greedy_alone(make_engine(), PROMPTS)
    # 30 blocks of 4 tokens: the longest request (91 prompt + 10 tokens, 26 blocks)
    # fits alone, not beside the others.
    tight = make_engine(num_blocks=30, block_size=4, max_num_batched_tokens=32)

    outs = tight.generate(PROMPTS, GREEDY)

    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert tight.kv.blocks.num_used_blocks == 0


def test_it_gives_the_same_tokens_with_chunked_prefill(make_engine):
    prompt = PROMPTS[4]
    whole = make_engine(max_num_batched_tokens=512).generate([prompt], GREEDY)[0]

    chunked = make_engine(max_num_batched_tokens=7).generate([prompt], GREEDY)[0]

    assert chunked.token_ids == whole.token_ids


def test_it_samples_the_same_seeded_tokens_batched_or_alone(make_engine):
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    alone = make_engine().generate([PROMPTS[0]], seeded)[0]

    batch = make_engine().generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        [SamplingParams(max_tokens=8, temperature=1.0), seeded, GREEDY],
    )

    assert batch[1].token_ids == alone.token_ids


def test_it_stops_at_a_stop_string_and_leaves_it_out(make_engine):
    free = make_engine().generate([PROMPTS[0]], GREEDY)[0]
    stop = free.text[3:5]

    out = make_engine().generate(
        [PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0.0, stop=[stop])
    )[0]

    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]


def test_it_stops_at_a_stop_token_and_counts_it(make_engine):
    free = make_engine().generate([PROMPTS[0]], GREEDY)[0]
    stop_token = free.token_ids[3]
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_token])

    out = make_engine().generate([PROMPTS[0]], params)[0]

    first = free.token_ids.index(stop_token)
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]


def test_it_streams_deltas_that_add_up_to_the_final_text(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=["zz"])
    engine.add_request("k", PROMPTS[1], params)

    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out

    assert "".join(deltas) == final.text
    assert all("\ufffd" not in d or final.finished for d in deltas[:-1])


def test_it_frees_blocks_at_once_on_abort(make_engine):
    engine = make_engine()
    engine.add_request("a", PROMPTS[4], GREEDY)
    engine.add_request("b", PROMPTS[0], GREEDY)
    engine.step()
    held_by_b = len(engine.kv.blocks.block_table("b"))

    assert engine.abort("a")

    assert engine.kv.blocks.num_used_blocks == held_by_b
    assert not engine.abort("a")


def test_it_rejects_a_request_longer_than_the_context(make_engine):
    engine = make_engine(max_model_len=32)

    with pytest.raises(RequestTooLargeError, match="maximum context length is 32"):
        engine.add_request("big", "y" * 40, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)


def test_it_counts_tokens_and_preemptions_in_metrics(make_engine):
    engine = make_engine(num_blocks=30, block_size=4, max_num_batched_tokens=32)

    outs = engine.generate(PROMPTS, GREEDY)

    registry = engine.metrics.registry
    generated = registry.get_sample_value("engine_generation_tokens_total")
    assert generated == sum(len(o.token_ids) for o in outs)
    preemptions = registry.get_sample_value("engine_preemptions_total")
    assert preemptions == engine.scheduler.num_preemptions > 0
    assert registry.get_sample_value("engine_kv_blocks_used") == 0
    ttft = registry.get_sample_value("engine_time_to_first_token_seconds_count")
    assert ttft == len(PROMPTS)


def test_it_observes_the_running_batch_once_per_step(make_engine):
    engine = make_engine(max_num_seqs=4)
    for i, prompt in enumerate(PROMPTS):  # 6 requests, 4 run at a time
        engine.add_request(str(i), prompt, GREEDY)
    running = []  # the sequences each step computed
    schedule = engine.scheduler.schedule

    def schedule_and_count():
        out = schedule()
        running.append(len({c.seq.request_id for c in out.chunks}))
        return out

    engine.scheduler.schedule = schedule_and_count
    while engine.has_unfinished_requests():
        engine.step()

    def steps(name: str, **labels: str) -> float:
        sample = "engine_iteration_num_requests_running" + name
        return engine.metrics.registry.get_sample_value(sample, labels)

    assert max(running) == 4 and min(running) < 4
    assert steps("_count") == len(running) and steps("_sum") == sum(running)
    for count in range(5):  # one bucket per count, 0 .. max_num_seqs
        at_most = sum(r <= count for r in running)
        assert steps("_bucket", le=f"{count:.1f}") == at_most


def test_it_lays_out_attention_metadata_for_mixed_batches(make_engine):
    engine = make_engine(block_size=4)
    engine.add_request("a", [1, 2, 3, 4, 5, 6], GREEDY)
    engine.step()  # a: prefill, now decoding
    engine.add_request("b", [7, 8, 9], GREEDY)

    out = engine.scheduler.schedule()
    ids, positions, attn = prepare_inputs(out.chunks, engine.kv.blocks, engine.device)

    a_table = engine.kv.blocks.block_table("a")
    assert positions.tolist() == [6, 0, 1, 2]
    assert ids.tolist()[1:] == [7, 8, 9]
    assert attn.query_start_loc.tolist() == [0, 1, 4]
    assert attn.context_lens.tolist() == [7, 3]
    assert attn.slot_mapping.tolist()[0] == a_table[1] * 4 + 2
    assert not attn.decode_only
    assert attn.window_slots is None and attn.window_rows is None


def test_it_lays_out_window_slots_and_rows_for_mixed_batches(make_engine):
    engine = make_engine(block_size=4, kv_cache_dtype="int4", kv_window=2)
    engine.add_request("a", [1, 2, 3, 4, 5, 6], GREEDY)
    engine.step()
    engine.add_request("b", [7, 8, 9], GREEDY)

    out = engine.scheduler.schedule()
    _, _, attn = prepare_inputs(out.chunks, engine.kv.blocks, engine.device)

    row_a, row_b = (engine.kv.blocks.window_row(s) for s in "ab")
    assert row_a != row_b
    assert attn.window_rows.tolist() == [row_a, row_b]
    # a decodes position 6; b prefills 0..2, of which 1 and 2 are its newest two.
    assert attn.window_slots.tolist() == [row_a * 2 + 0, -1, row_b * 2 + 1, row_b * 2]


def test_it_streams_through_the_async_engine_and_aborts_on_close(make_engine):
    engine = make_engine()
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def scenario():
        done = async_engine.submit(PROMPTS[0], GREEDY)
        texts = [out.new_text async for out in done]
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = async_engine.submit(PROMPTS[1], long)
        async for out in stream:
            if len(out.token_ids) >= 2:
                break
        stream.close()
        for _ in range(200):
            if engine.kv.blocks.num_used_blocks == 0:
                break
            await asyncio.sleep(0.01)
        return texts

    try:
        texts = asyncio.run(scenario())
    finally:
        async_engine.shutdown()

    assert "".join(texts) == make_engine().generate([PROMPTS[0]], GREEDY)[0].text
    assert len(texts) == GREEDY.max_tokens
    assert engine.kv.blocks.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    assert async_engine.num_live_streams == 0


def test_it_samples_the_same_seeded_tokens_when_preempted(make_engine):
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    roomy = make_engine().generate(PROMPTS, params)
    tight = make_engine(num_blocks=30, block_size=4, max_num_batched_tokens=32)

    outs = tight.generate(PROMPTS, params)

    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_it_fails_only_the_batch_when_a_step_raises(make_engine, monkeypatch):
    engine = make_engine()
    async_engine = AsyncLLMEngine(engine)
    real_forward = engine._forward
    calls = {"n": 0}

    def flaky_forward(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return real_forward(chunks)

    monkeypatch.setattr(engine, "_forward", flaky_forward)
    async_engine.start()

    async def scenario():
        with pytest.raises(RuntimeError, match="device fell over"):
            async for _ in async_engine.submit(PROMPTS[0], GREEDY):
                pass
        return [out async for out in async_engine.submit(PROMPTS[0], GREEDY)]

    try:
        outs = asyncio.run(scenario())
    finally:
        async_engine.shutdown()

    assert outs[-1].finished and len(outs[-1].token_ids) == GREEDY.max_tokens
    assert async_engine.step_errors == 1
    assert engine.kv.blocks.num_used_blocks == 0


def test_it_detokenizes_each_streamed_token_a_bounded_number_of_times(
    make_engine, monkeypatch
):
    engine = make_engine(num_blocks=64, block_size=4)
    decoded = []
    real_decode = engine.tokenizer.decode

    def counting_decode(ids, skip_special_tokens=False):
        decoded.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    monkeypatch.setattr(engine.tokenizer, "decode", counting_decode)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    out = engine.generate(["x"], params)[0]

    assert len(out.token_ids) == 200
    assert out.text == real_decode(out.token_ids, skip_special_tokens=True)
    # Decoding the whole output on every token would be ~20,000 ids.
    assert sum(decoded) < 10 * 200


def test_it_adds_bos_to_a_plain_prompt_only_where_the_tokenizer_does(
    real_model_and_tokenizer, tiny_model_and_tokenizer
):
    from gpuagent.engine.engine import LLMEngine

    for model, tokenizer in (real_model_and_tokenizer, tiny_model_and_tokenizer):
        engine = LLMEngine(model, tokenizer, num_blocks=4, prepack_weights=False)
        ids = engine.encode_prompt("Hello there")
        assert ids == tokenizer.encode_prompt("Hello there")
        assert (ids[0] == tokenizer.bos_token_id) is (
            tokenizer is not real_model_and_tokenizer[1]
        )
