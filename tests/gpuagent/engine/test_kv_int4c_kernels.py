"""int4c through the paged attention kernels (Triton interpreter on the CPU):
`kv_int4c.attention` with impl="triton" against its torch attention on the same
writes (shuffled blocks, partial last blocks, contexts shorter and longer than
the window, chunked prefill, decode, decode rows of a mixed step), position 0
read from the row's sink slot, and the demo model's greedy tokens."""

from __future__ import annotations

import functools

import pytest
import torch

import kernels
from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.engine import kv_int4c
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.model import AttentionMetadata
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from kernels.paged_attention import _paged_decode_triton

KVH, HEADS, D = 2, 4, 32  # GQA groups of 2; the kernels' smallest head_dim for int4
BLOCK, WINDOW = 4, 6  # a window row of 5 newest tokens + position 0
# each sequence's physical blocks, in no order (block 5 is nobody's)
TABLES = [[7, 2, 9, 0, 11, 4, 6], [3, 10, 1, 8, 12, 13, 5]]


def metadata(starts, counts, inv_freq, decode_only=False):
    # one step: sequence b adds counts[b] tokens after its first starts[b]
    positions, slots = [], []
    for table, start, count in zip(TABLES, starts, counts, strict=True):
        for p in range(start, start + count):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
    qsl = [0]
    for count in counts:
        qsl.append(qsl[-1] + count)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(TABLES, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        context_lens=torch.tensor(
            [s + c for s, c in zip(starts, counts, strict=True)], dtype=torch.int32
        ),
        decode_only=decode_only,
        window_rows=torch.tensor([1, 0], dtype=torch.int32),
        positions=torch.tensor(positions),
        rope_inv_freq=inv_freq,
    )


def new_cache(mean):
    cache = kernels.allocate_kv_cache(
        "int4c", 14, BLOCK, KVH, D, window=WINDOW, num_windows=2
    )
    kv_int4c.set_key_means([cache], [mean])
    return cache


# (tokens per sequence, decode_only, rows wanted): prefill chunks (shorter than
# the window, then past it), a mixed step read at its last rows (the decode
# kernel), and decodes until both contexts span several partial blocks.
STEPS = (
    ((3, 9), False, None),
    ((8, 5), False, None),
    ((1, 4), False, "last"),
    *(((1, 1), True, None),) * 4,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_attend_as_the_torch_path_does(dtype):
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    mean = 2.0 + 0.5 * torch.randn(KVH, D, generator=g)  # keys far off zero
    caches = {impl: new_cache(mean) for impl in ("triton", "reference")}
    starts = [0, 0]
    for counts, decode_only, rows in STEPS:
        n = sum(counts)
        q = torch.randn(n, HEADS, D, generator=g).to(dtype)
        k = (mean + torch.randn(n, KVH, D, generator=g)).to(dtype)
        v = torch.randn(n, KVH, D, generator=g).to(dtype)
        attn = metadata(starts, counts, inv_freq, decode_only)
        out_rows = attn.query_start_loc[1:].long() - 1 if rows else None
        outs = {
            impl: kv_int4c.attention(q, k, v, cache, attn, D**-0.5, out_rows, impl)
            for impl, cache in caches.items()
        }

        torch.testing.assert_close(outs["triton"], outs["reference"], rtol=0, atol=2e-5)
        starts = [s + c for s, c in zip(starts, counts, strict=True)]
    assert starts == [16, 22]  # past the window, last blocks partial
    tri, ref = caches["triton"], caches["reference"]
    names = ("key", "value", "key_scale", "value_scale", "window_key", "window_value")
    for name in names:
        assert torch.equal(getattr(tri, name), getattr(ref, name)), name


def test_position_0_comes_from_the_sink_slot():
    # Position 0's bf16 copy lives in the row's last slot: changing that slot's
    # value changes what the kernel reads, as it changes the torch path's.
    g = torch.Generator().manual_seed(1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    mean = torch.randn(KVH, D, generator=g)
    n = 20
    prefill = metadata([0, 0], [n, n], inv_freq)
    q = torch.randn(2 * n, HEADS, D, generator=g)
    k = torch.randn(2 * n + 2, KVH, D, generator=g)
    v = torch.randn(2 * n + 2, KVH, D, generator=g)
    decode = metadata([n, n], [1, 1], inv_freq, decode_only=True)
    outs = {}
    for name, impl, bump in (
        ("plain", "triton", 0.0),
        ("bumped", "triton", 30.0),
        ("bumped-torch", "reference", 30.0),
    ):
        cache = new_cache(mean)
        kv_int4c.attention(q, k[:-2], v[:-2], cache, prefill, 1.0, None)
        cache.window_value[:, WINDOW - 1] += bump  # both rows' position 0
        outs[name] = kv_int4c.attention(
            q[:2], k[-2:], v[-2:], cache, decode, 1.0, None, impl
        )

    torch.testing.assert_close(outs["bumped"], outs["bumped-torch"], rtol=0, atol=2e-5)
    assert (outs["bumped"] - outs["plain"]).abs().max() > 1e-2


def test_a_split_context_merges_to_the_single_pass():
    # The decode kernel over partitions of 16 tokens (the merge kernel) gives
    # what one partition gives.
    g = torch.Generator().manual_seed(2)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    cache = new_cache(torch.randn(KVH, D, generator=g))
    n = 25
    q = torch.randn(2 * n, HEADS, D, generator=g)
    k = torch.randn(2 * n, KVH, D, generator=g)
    attn = metadata([0, 0], [n, n], inv_freq)
    kv_int4c.attention(q, k, k, cache, attn, 1.0, None, "reference")
    query = torch.randn(2, HEADS, D, generator=g)
    args = (query, cache, attn.block_tables, attn.context_lens, 1.0)
    rows, rope = attn.window_rows, (inv_freq, torch.float32)

    whole = _paged_decode_triton(*args, rows, rope)
    split = _paged_decode_triton(*args, rows, rope, partition_size=16, block_n=16)

    torch.testing.assert_close(split, whole, rtol=0, atol=1e-5)


def test_the_ops_want_rope_for_int4c_and_have_no_torch_reference():
    cache = new_cache(torch.zeros(KVH, D))
    args = (
        torch.zeros(1, HEADS, D),
        cache,
        torch.zeros(1, 2, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        0.125,
        torch.zeros(1, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="int4c attention needs rope="):
        kernels.paged_decode_attention(*args, impl="triton")
    rope = (torch.ones(D // 2), torch.float32)
    with pytest.raises(ValueError, match="torch reference has no int4c path"):
        kernels.paged_decode_attention(*args, impl="reference", rope=rope)
    unset = kernels.allocate_kv_cache(
        "int4c", 2, BLOCK, KVH, D, window=4, num_windows=1
    )
    with pytest.raises(ValueError, match="needs its key means"):
        kernels.paged_decode_attention(args[0], unset, *args[2:], rope=rope)


def test_the_demo_model_decodes_the_same_greedy_tokens(monkeypatch):
    from gpuagent.engine.loader import load_model

    model = load_model(DEMO_MODEL_DIR)
    prompt = "The quick brown fox jumps over the lazy dog."  # past a window of 8
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )

    def generate():
        served = LLMEngine(
            model,
            load_tokenizer(DEMO_MODEL_DIR),
            kv_cache_dtype="int4c",
            num_blocks=8,
            kv_window=8,
            prepack_weights=False,
        )
        out = served.generate([prompt], params)[0]
        scored = [t.logprob for t in out.prompt_logprobs[1:] + out.logprobs]
        return out.token_ids, torch.tensor(scored)

    torch_tokens, torch_logprobs = generate()
    attention = kv_int4c.attention
    monkeypatch.setattr(
        kv_int4c, "attention", functools.partial(attention, impl="triton")
    )
    calls = []
    real = kernels.paged_attention._paged_decode_triton

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(kernels.paged_attention, "_paged_decode_triton", spy)
    tokens, logprobs = generate()

    assert tokens == torch_tokens
    # the prompt's (prefill kernel) and the generated tokens' (decode kernel),
    # within float32 rounding of the two paths' sums: largest gap 1.27e-4 on a
    # logprob of -8.9 (1.4e-5 relative) on an AVX2 host, under 1e-4 on AVX-512
    torch.testing.assert_close(logprobs, torch_logprobs, rtol=3e-5, atol=1e-4)
    assert len(calls) >= model.config.num_hidden_layers * (params.max_tokens - 1)


def test_a_prefix_cache_hit_through_the_kernels_scores_as_a_cold_run(monkeypatch):
    # a hit copies position 0 from its first block's sink into the row's last
    # slot, which the kernels read; a hit whose sink copy the kernels missed reads
    # another sequence's position 0 there (or zeros) and scores differently
    from gpuagent.engine.loader import load_model

    model = load_model(DEMO_MODEL_DIR)
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    monkeypatch.setattr(
        kv_int4c, "attention", functools.partial(kv_int4c.attention, impl="triton")
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    shared = "The quick brown fox jumps over the lazy dog. " * 4

    def engine(caching: bool) -> LLMEngine:
        return LLMEngine(
            model,
            tokenizer,
            kv_cache_dtype="int4c",
            num_blocks=24,
            block_size=16,
            kv_window=8,
            enable_prefix_caching=caching,
            prepack_weights=False,
        )

    on, off = engine(True), engine(False)
    on.generate([shared + "A cat"], params)  # caches the shared blocks
    warm = on.generate([shared + "A dog"], params)[0]
    cold = off.generate([shared + "A dog"], params)[0]
    assert warm.num_cached_tokens > 0
    assert warm.token_ids == cold.token_ids
    torch.testing.assert_close(
        torch.tensor([t.logprob for t in warm.logprobs]),
        torch.tensor([t.logprob for t in cold.logprobs]),
        rtol=0,
        atol=1e-4,
    )
