"""Prefix caching end to end on the trained demo model (`gpuagent.engine.cache`):
the same greedy tokens with the cache on and off on every served KV dtype, what a
request reports cached, the full-precision window rebuilt exactly after a cached
prefix (fp8, int4, int4c with its sink), the sink evicted with its block,
preemption of sequences that share blocks, and hash roots that keep caches of
other bytes apart."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpuagent.engine
import kernels
from gpuagent.engine.engine import LLMEngine, default_kv_window
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.evaluate.evalsets import load_text_slices
from kernels import kv_quant
from tests.gpuagent.engine.conftest import make_tiny_model_dir

DEMO_DIR = Path(gpuagent.engine.__file__).parent / "demo_model"
KV_DTYPES = ("bf16", "int8", "fp8", "int4", "int4c")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_DIR), load_tokenizer(DEMO_DIR)


@pytest.fixture(scope="module")
def passages() -> list[str]:
    """The eval sets' passages: English first, then code and Korean ones."""
    english, code, korean = (s.passages for s in load_text_slices())
    return [*english[:4], code[0], korean[0], code[1], korean[1], english[4]]


def make_engine(demo, kv_dtype: str, caching: bool = True, **kwargs) -> LLMEngine:
    model, tokenizer = demo
    kwargs.setdefault("num_blocks", 160)
    kwargs.setdefault("max_num_batched_tokens", 128)
    return LLMEngine(
        model,
        tokenizer,
        kv_cache_dtype=kv_dtype,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=caching,
        **kwargs,
    )


def refill_tokens(layers: int, kv_dtype: str, window: int) -> int:
    """Positions recomputed before a cached prefix (the window rule): a window
    per layer, less the query itself; int4c's row holds window - 1 of the newest
    positions (its last slot is position 0, copied from a sink)."""
    newest = window - 1 if kv_dtype == "int4c" else window
    return layers * (newest - 1) if window else 0


def serve_sessions(engine: LLMEngine, passages: list[str]) -> dict[str, object]:
    """Three sessions share a system prompt and start together; three more join
    while they decode (one shares only part of it); then each session's second
    turn carries its first answer. Returns each request's final output."""
    system = passages[0] + "\n\n"
    first = {f"a{i}": system + passages[1 + i][:80] for i in range(3)}
    joining = {f"b{i}": system + passages[4 + i][:60] for i in range(2)}
    joining["b2"] = system[:150] + passages[7][:90]
    outputs: dict[str, object] = {}

    def run(prompts: dict[str, str], join: dict[str, str] | None = None) -> None:
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, GREEDY)
        steps = 0
        while engine.has_unfinished_requests():
            if join and steps == 4:
                for request_id, prompt in join.items():
                    engine.add_request(request_id, prompt, GREEDY)
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
            steps += 1

    run(first, joining)
    prompts = {**first, **joining}
    run(
        {
            f"{k}-2": p + outputs[k].text + "\n" + passages[8][:40]
            for k, p in prompts.items()
        }
    )
    return outputs


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_it_gives_the_same_greedy_tokens_with_the_cache_on_and_off(
    demo, passages, kv_dtype
):
    off = serve_sessions(make_engine(demo, kv_dtype, caching=False), passages)
    engine = make_engine(demo, kv_dtype)

    on = serve_sessions(engine, passages)

    assert {k: o.token_ids for k, o in on.items()} == {
        k: o.token_ids for k, o in off.items()
    }
    assert all(o.num_cached_tokens == 0 for o in off.values())
    # the joiners and every second turn started from cached blocks
    hits = {k for k, o in on.items() if o.num_cached_tokens > 0}
    assert {"b0", "b1", "b2"} | {f"{k}-2" for k in ("a0", "a1", "b0")} <= hits
    assert engine.kv.blocks.num_used_blocks == 0


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_it_reports_the_full_blocks_of_the_shared_prefix_as_cached(
    demo, passages, kv_dtype
):
    engine = make_engine(demo, kv_dtype)
    first = engine.encode_prompt(passages[0] + passages[1])
    shared = 203  # not a block boundary
    second = first[:shared] + engine.encode_prompt(passages[2])[:50]
    engine.generate([first], GREEDY)

    out = engine.generate([second], GREEDY)[0]

    full_blocks = shared // BLOCK_SIZE * BLOCK_SIZE  # 192
    refill = refill_tokens(
        engine.config.num_hidden_layers, kv_dtype, default_kv_window(kv_dtype)
    )
    expected = max(0, full_blocks - refill)
    assert out.num_cached_tokens == expected
    registry = engine.metrics.registry
    for prefix in ("engine_", "vllm:"):
        queries = registry.get_sample_value(f"{prefix}prefix_cache_queries_total")
        hits = registry.get_sample_value(f"{prefix}prefix_cache_hits_total")
        assert (queries, hits) == (len(first) + len(second), expected)


def test_it_recomputes_the_last_block_of_a_prompt_that_is_all_cached(demo, passages):
    engine = make_engine(demo, "bf16")
    prompt = engine.encode_prompt(passages[0])[: 10 * BLOCK_SIZE]
    cold = engine.generate([prompt], GREEDY)[0]

    warm = engine.generate([prompt], GREEDY)[0]

    assert warm.num_cached_tokens == 9 * BLOCK_SIZE
    assert warm.token_ids == cold.token_ids


def test_it_computes_every_token_with_the_cache_off(demo, passages):
    engine = make_engine(demo, "bf16", caching=False)
    engine.generate([passages[0]], GREEDY)

    out = engine.generate([passages[0]], GREEDY)[0]

    assert out.num_cached_tokens == 0
    assert engine.kv.blocks.pool.num_cached_blocks == 0
    registry = engine.metrics.registry
    assert registry.get_sample_value("engine_prefix_cache_queries_total") == 0


@pytest.mark.parametrize("kv_dtype", ["fp8", "int4", "int4c"])
def test_it_rebuilds_the_window_exactly_after_a_cached_prefix(demo, passages, kv_dtype):
    # The window rule (gpuagent/engine/cache.py): a hit of C tokens recomputes from
    # C - layers * (window - 1) (int4c: window - 2, and copies position 0 from the
    # sink). With the budget set so that the run without the cache computes the
    # same last chunk, every logprob is the same float; a refill of just the
    # window (the newest tokens at the prefix's end) is not.
    prompt = make_engine(demo, "bf16").encode_prompt(passages[0])[:300]
    cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)

    def logprobs(refill: int | None) -> tuple[list[float], int]:
        """Logprob differences off - on, and the tokens cached, with the engine's
        own refill (None) or `refill`."""
        if refill is None:
            refill = make_engine(demo, kv_dtype).kv.blocks.window_refill_tokens
        budget = {"max_num_batched_tokens": cached - refill}
        off = make_engine(demo, kv_dtype, caching=False, **budget)
        on = make_engine(demo, kv_dtype, **budget)
        on.kv.blocks.window_refill_tokens = refill
        on.generate([prompt], params)
        cold = off.generate([prompt], params)[0]
        warm = on.generate([prompt], params)[0]
        assert warm.token_ids == cold.token_ids
        diff = [
            a.logprob - b.logprob
            for a, b in zip(cold.logprobs, warm.logprobs, strict=True)
        ]
        return diff, warm.num_cached_tokens

    exact, num_cached = logprobs(None)
    window_only, _ = logprobs(default_kv_window(kv_dtype))

    layers = demo[0].config.num_hidden_layers
    window = default_kv_window(kv_dtype)
    assert num_cached == cached - refill_tokens(layers, kv_dtype, window)
    assert exact == [0.0] * len(exact)
    assert any(d != 0.0 for d in window_only)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4c"])
def test_it_preempts_sequences_that_share_blocks_to_the_same_tokens(
    demo, passages, kv_dtype
):
    system = passages[0][:200]
    prompts = [system + passages[1 + i][: 40 + 10 * i] for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = make_engine(demo, kv_dtype, caching=False).generate(prompts, params)
    # 32 blocks of 16: the shared 12 and three sequences.s own 7 or so at most
    tight = make_engine(demo, kv_dtype, num_blocks=32)
    tight.generate(prompts[:1], params)

    outs = tight.generate(prompts, params)

    assert tight.scheduler.num_preemptions > 0
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.kv.blocks.num_used_blocks == 0


def test_it_recomputes_position_0_once_its_sink_went_with_its_block(demo, passages):
    # int4c: a hit reads position 0 from its first block's sink (a spoiled sink
    # shows in the logits); the sink goes when the pool hands the block out again,
    # and the same prompt then computes from position 0, to the same logits
    prompt = make_engine(demo, "bf16").encode_prompt(passages[0])[:200]
    other = make_engine(demo, "bf16").encode_prompt(passages[1])[:200]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    engine = make_engine(demo, "int4c", num_blocks=13)  # 204 tokens each
    blocks = engine.kv.blocks
    cold = engine.generate([prompt], params)[0]
    first = blocks.pool.cached_block(
        blocks.extend_block_hashes([], lambda a, b: prompt[a:b], BLOCK_SIZE)[0]
    )
    sink = blocks.pool.sink_of(first)

    def logprob_gap(out) -> float:
        return max(
            abs(a.logprob - b.logprob)
            for a, b in zip(out.logprobs, cold.logprobs, strict=True)
        )

    hit = engine.generate([prompt], params)[0]
    engine.kv.sink_key[0][sink] += 1.0
    spoiled = engine.generate([prompt], params)[0]
    engine.generate([other], params)  # every block: evicts the first
    evicted = blocks.pool.block_hash(first) is None, blocks.pool.sink_of(first)

    again = engine.generate([prompt], params)[0]

    assert sink is not None and evicted == (True, None)
    assert hit.num_cached_tokens == spoiled.num_cached_tokens == 192 - 4 * 16
    assert hit.token_ids == cold.token_ids and logprob_gap(hit) < 1e-4
    assert logprob_gap(spoiled) > 1e-3
    assert again.num_cached_tokens == 0
    assert again.logprobs == cold.logprobs


def test_it_roots_block_hashes_in_everything_that_changes_their_bytes(
    demo, tiny_model_and_tokenizer, tmp_path
):
    def root(model_and_tokenizer, kv_dtype, **kwargs) -> bytes:
        model, tokenizer = model_and_tokenizer
        engine = LLMEngine(
            model, tokenizer, kv_cache_dtype=kv_dtype, num_blocks=4, **kwargs
        )
        return engine.kv.blocks.root_hash

    roots = {dtype: root(demo, dtype) for dtype in KV_DTYPES}
    fp8 = make_engine(demo, "fp8", num_blocks=4)
    digest = fp8.kv.prefix_cache_root(gpuagent.engine.cache.model_digest(demo[0]))
    fp8.kv.kv_caches[1].key_scale *= 2

    assert len(set(roots.values())) == len(KV_DTYPES)
    # the dtype alone: both rotated (or neither), no window, no static scales
    assert root(demo, "int4", kv_window=0) != roots["int8"]
    assert root(demo, "fp16") != roots["bf16"]
    assert root(demo, "int4") == roots["int4"]  # the same bytes, the same root
    assert root(demo, "int4", kv_window=0) != roots["int4"]
    assert root(demo, "bf16", block_size=8) != roots["bf16"]
    # the same layout written by another writer (int4 v2 picks its scales)
    assert kernels.kv_writer_version("int4") == 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_quant, "KV_WRITER_VERSIONS", {})
        assert root(demo, "int4") != roots["int4"]
    # other weights of the same shape
    retrained = make_tiny_model_dir(tmp_path / "retrained", seed=7)
    retrained_model = (load_model(retrained), load_tokenizer(retrained))
    assert root(retrained_model, "bf16") != root(tiny_model_and_tokenizer, "bf16")
    assert digest == fp8.kv.blocks.root_hash
    assert (
        fp8.kv.prefix_cache_root(gpuagent.engine.cache.model_digest(demo[0])) != digest
    )
