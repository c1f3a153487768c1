"""The int4c KV layout (engine.kv_int4c): its writer and reader are what
kv_alternatives simulated as sim-int4gc+w17s1 (per vector, and whole passages
through the engine), the write kernel refuses it by name, its key means are counted in
its bytes and in the prefix cache's root, and greedy decoding is the same with
the prefix cache on and off, a hit skipping the compute of its cached blocks
(position 0 copied from the first block's sink, `engine.cache`)."""

from __future__ import annotations

import pytest
import torch

import kernels
from gpuagent.benches import DEMO_MODEL_DIR, kv_long
from gpuagent.benches import kv_alternatives as alt
from gpuagent.engine import kv_int4c
from gpuagent.engine.cache import (
    KVCacheManager,
    kv_bytes_per_token,
    kv_sink_bytes,
    kv_static_bytes,
)
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.kv_calibration import calibration_sequences
from gpuagent.engine.model import AttentionMetadata
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.evaluate.evalsets import HeldOutPassage, load_text_slices
from kernels.kv_gauss import dequantize_gauss, quantize_gauss

KVH, D = 2, 64


@pytest.fixture(scope="module")
def demo_model():
    from gpuagent.engine.loader import load_model

    return load_model(DEMO_MODEL_DIR)


def test_the_writer_stores_what_the_simulation_reads():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, KVH, D, generator=g) * torch.rand(300, KVH, 1, generator=g)
    x[0] = 0  # a constant vector gets the smallest scale, finite
    x = x @ kernels.hadamard(D)

    codes, scale = quantize_gauss(x)

    assert codes.dtype == torch.uint8 and codes.shape == (300, KVH, D // 2)
    assert scale.dtype == torch.float16 and scale.shape == (300, KVH)
    assert torch.equal(dequantize_gauss(codes, scale), alt.int4_gauss_read(x))
    with pytest.raises(ValueError, match="even head_dim"):
        quantize_gauss(torch.zeros(3, 5))


def step(positions, slots, ctx, qsl, rows, block_tables, inv_freq):
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        decode_only=False,
        window_rows=torch.tensor(rows, dtype=torch.int32),
        positions=torch.tensor(positions),
        rope_inv_freq=inv_freq,
    )


def test_the_cache_attends_as_the_simulated_layout_does(demo_model):
    # One layer's q/k/v written in two chunks (10 then 30 tokens) into a paged
    # int4c cache with a window row of 6 (5 newest + the first position): every
    # query's output equals the simulation's attention over the same layout
    # (sim-int4gc+w5s1) with the same RoPE'd mean offsets.
    from gpuagent.engine.model import apply_rope, rope_cos_sin, rope_inv_freq

    config = demo_model.config
    n, heads = 40, 2 * KVH
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, heads, D, generator=g)
    k = torch.randn(n, KVH, D, generator=g) + 3.0
    v = torch.randn(n, KVH, D, generator=g)
    mean = torch.full((KVH, D), 3.0) + 0.1 * torch.randn(KVH, D, generator=g)
    cache = kernels.allocate_kv_cache("int4c", 10, 4, KVH, D, window=6, num_windows=2)
    kv_int4c.set_key_means([cache], [mean])
    inv_freq = rope_inv_freq(config)
    blocks = [9, 3, 5, 0, 7, 1, 2, 4, 6, 8]  # any block order
    slots = [blocks[p // 4] * 4 + p % 4 for p in range(n)]
    outs = []
    for lo, hi in ((0, 10), (10, 40)):
        attn = step(
            list(range(lo, hi)),
            slots[lo:hi],
            [hi],
            [0, hi - lo],
            [1],
            [blocks],
            inv_freq,
        )
        outs.append(
            kv_int4c.attention(q[lo:hi], k[lo:hi], v[lo:hi], cache, attn, 0.125, None)
        )
    served = torch.cat(outs)

    cos, sin = rope_cos_sin(inv_freq, torch.arange(n))
    offset = apply_rope(mean.expand(n, KVH, D), cos, sin)
    offset[0] = 0
    layout = alt.named_layout("sim-int4gc+w5s1")
    simulated = alt.layout_attention(q, k, v, 0.125, layout, offset)

    torch.testing.assert_close(served, simulated, rtol=0, atol=2e-5)
    exact = alt.layout_attention(q, k, v, 0.125, alt.BF16)
    assert (served - exact).abs().max() > 1e-3  # quantized, not bf16 throughout


def test_the_write_kernel_refuses_int4c_by_name():
    # (the attention kernels read it: test_kv_int4c_kernels.py)
    cache = kernels.allocate_kv_cache("int4c", 2, 4, KVH, D, window=4, num_windows=1)
    x = torch.zeros(1, KVH, D)
    with pytest.raises(ValueError, match="write_kv has no int4c path"):
        kernels.write_kv(cache, x, x, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="window of at least 2"):
        kernels.allocate_kv_cache("int4c", 2, 4, KVH, D)


def test_its_bytes_are_int4s_plus_the_key_means(demo_model):
    config = demo_model.config
    layers = config.num_hidden_layers
    assert kv_bytes_per_token(config, "int4c") == kv_bytes_per_token(config, "int4")
    means = layers * KVH * D * 4  # float32 [KVH, D] per layer
    assert kv_static_bytes(config, "int4c") == means
    kv = KVCacheManager(config, "int4c", 6, 16, window=18, num_windows=2)
    int4 = KVCacheManager(config, "int4", 6, 16, window=18, num_windows=2)
    # and one sink (position 0's bf16 K/V) per window row for cached first blocks
    assert kv.nbytes == int4.nbytes + means + 2 * kv_sink_bytes(config)
    # as the simulation counts sim-int4gc+w17s1 at the measured length, plus the
    # sink store's copy of position 0 (the row's last slot) per window row
    sink = kv_sink_bytes(config) / 2048 / kv_bytes_per_token(config, "bf16")
    assert kv_long.measured_bytes_ratio(config, "int4c", 18, 2048) == pytest.approx(
        alt.named_layout("sim-int4gc+w17s1").bytes_ratio(config, 2048) + sink
    )


def engine(demo_model, **kw) -> LLMEngine:
    kw = {"kv_cache_dtype": "int4c", "num_blocks": 48, **kw}
    return LLMEngine(
        demo_model, load_tokenizer(DEMO_MODEL_DIR), prepack_weights=False, **kw
    )


def test_the_engine_calibrates_its_key_means_at_start(demo_model):
    served = engine(demo_model)
    means = kv_int4c.key_means(demo_model, calibration_sequences(served.tokenizer))

    assert served.kv.window == 18
    for cache, mean in zip(served.kv.kv_caches, means, strict=True):
        assert cache.means_set and torch.equal(cache.key_mean, mean)
    other = engine(demo_model)
    root = served.kv.prefix_cache_root(b"model")
    assert other.kv.prefix_cache_root(b"model") == root
    other.kv.kv_caches[0].key_mean[0, 0] += 1.0
    assert other.kv.prefix_cache_root(b"model") != root
    int4 = engine(demo_model, kv_cache_dtype="int4")
    assert int4.kv.prefix_cache_root(b"model") != root


def test_greedy_tokens_are_the_same_with_the_prefix_cache_on_and_off(demo_model):
    # a shared 271-token prefix (block size 16: 16 cached blocks) then distinct
    # tails; the second request hits the cache, copies position 0 from the first
    # block's sink and recomputes 4 layers * 16 positions into its window row
    shared = "The quick brown fox jumps over the lazy dog. " * 6
    prompts = [shared + "Then it", shared + "After that the fox"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    off = engine(demo_model)
    on = engine(demo_model, enable_prefix_caching=True)
    hits = []
    lookup = on.kv.blocks.cached_prefix

    def spy(*args):
        hits.append(len(found := lookup(*args)))
        return found

    on.kv.blocks.cached_prefix = spy
    plain = [off.generate([p], params)[0].token_ids for p in prompts]
    cached = [on.generate([p], params)[0] for p in prompts]

    assert [c.token_ids for c in cached] == plain
    assert hits[-1] == 16  # the shared blocks were found and reused
    assert cached[1].num_cached_tokens == 16 * 16 - 4 * (18 - 2)


def test_a_passage_through_the_engine_scores_what_the_simulation_scores(demo_model):
    texts = [
        HeldOutPassage(s.name, "first", s.passages[0]) for s in load_text_slices()
    ][:2]
    layouts = [alt.named_layout("sim-int4gc+w17s1")]

    stats, lengths = kv_long.score_passages(
        DEMO_MODEL_DIR,
        demo_model,
        ("int4c",),
        layouts,
        progress=lambda _: None,
        passages=texts,
        min_tokens=16,
    )

    for text in texts:
        (served,) = stats["int4c"][text.slice]
        (simulated,) = stats[layouts[0].name][text.slice]
        assert 0 < served.kld.mean()
        # float summation order alone moves an int4 KLD a little (kv_alternatives)
        assert served.kld.mean() == pytest.approx(simulated.kld.mean(), rel=0.1)
        assert abs(served.same_top1.mean() - simulated.same_top1.mean()) <= 0.02


def test_batched_sequences_decode_as_they_do_alone(demo_model):
    # each sequence reads its own blocks, window row and first position: a batch
    # (chunked prefill beside decodes, rows reused) changes no greedy token
    prompts = [
        "hello world",
        "The quick brown fox jumps over the lazy dog. " * 3,
        "def add(a, b):\n    return",
        "x",
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [
        engine(demo_model, kv_window=4).generate([p], params)[0].token_ids
        for p in prompts
    ]

    batched = engine(demo_model, kv_window=4, max_num_batched_tokens=16).generate(
        prompts, params
    )

    assert [out.token_ids for out in batched] == alone


def test_attention_other_than_llamas_is_refused_by_name(demo_model):
    from gpuagent.engine.arch import GLMAttention

    class Other(GLMAttention):
        pass

    layer = demo_model.layers[0]
    kept = layer.self_attn
    layer.self_attn = Other.__new__(Other)
    try:
        with pytest.raises(ValueError, match="int4c KV is for Llama attention.*Other"):
            kv_int4c.key_means(demo_model, [[1, 2, 3]])
    finally:
        layer.self_attn = kept
