"""The KIVI simulation: its int4 quantizer round-trips within half a step, its
residual tokens are read exact (bf16), queries read what KIVI's decode step holds,
the batched attention equals a slow loop over decode steps, its bytes are counted
with the scales and the residual row, and on the demo model the simulation scores
what the engine scores."""

from __future__ import annotations

import pytest
import torch

import kernels
from gpuagent.benches import engine as bench
from gpuagent.benches import kv_alternatives as alt
from gpuagent.engine.cache import kv_bytes_per_token
from kernels.kv_gauss import GAUSS16

KVH, D = 2, 64


def keys_with_outliers(n: int, seed: int = 0) -> torch.Tensor:
    """[n, KVH, D] float32 with an offset and a few loud channels, as real keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, KVH, D, generator=g)
    x[..., :4] = x[..., :4] * 20 + 5  # outlier channels, off-centre
    return x


def assert_within_half_a_step(x, read, scale, steps_dim_group):
    dim, group = steps_dim_group
    # each element's own group scale, broadcast back over the group
    step = scale.float().repeat_interleave(group, dim=dim)
    bound = step / 2 * (1 + 1e-5) + 1e-6 * x.abs()
    assert ((x - read).abs() <= bound).all()


def test_it_round_trips_keys_per_channel_within_half_a_step():
    key = keys_with_outliers(96)

    codes, scale, minimum = alt.quantize_minmax(key, 0, 32)
    read = alt.dequantize_minmax(codes, scale, minimum, 0, 32)

    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert codes.shape == key.shape
    # one min and scale per channel per group of 32 tokens, float16
    assert scale.shape == minimum.shape == (3, KVH, D)
    assert scale.dtype == minimum.dtype == torch.float16
    assert_within_half_a_step(key, read, scale, (0, 32))
    # per channel: the outlier channels get their own (coarse) steps
    assert scale[..., :4].float().min() > 5 * scale[..., 4:].float().max()
    # both ends of every group's range are levels within half a step
    assert (minimum.float() <= key.unflatten(0, (3, 32)).amin(1)).all()


def test_it_round_trips_values_per_token_within_half_a_step():
    value = keys_with_outliers(40, seed=1)

    codes, scale, minimum = alt.quantize_minmax(value, -1, 32)
    read = alt.dequantize_minmax(codes, scale, minimum, -1, 32)

    assert scale.shape == (40, KVH, 2)  # per token, per 32 channels
    assert_within_half_a_step(value, read, scale, (-1, 32))
    assert torch.equal(alt.kivi_values(value, 32), read)


def test_a_constant_group_reads_back_its_value():
    key = torch.full((32, 1, 8), -1.25)

    assert torch.equal(alt.kivi_keys(key, 32), key)


def test_it_quantizes_only_complete_key_groups():
    key = keys_with_outliers(70)

    read = alt.kivi_keys(key, 32)

    assert torch.equal(read[64:], key[64:])  # the unfilled group: never quantized
    assert not torch.equal(read[:64], key[:64])
    # a group's quantization depends on its own tokens only
    assert torch.equal(read[:64], alt.kivi_keys(key[:64], 32))


def test_queries_read_what_kivis_decode_step_holds():
    layout = alt.kivi_layout(32, 64)

    keys_below, values_below = layout.quantized_below(200)

    # keys: flushed R at a time, after the step whose token fills the residual
    assert keys_below[63] == 0 and keys_below[64] == 64 and keys_below[127] == 64
    assert keys_below[128] == 128
    # values: the newest R and the new token in bf16, sliding
    assert values_below[64] == 0 and values_below[65] == 1 and values_below[199] == 135
    with pytest.raises(ValueError, match="multiple"):
        alt.kivi_layout(32, 48)


@pytest.mark.parametrize("t", [0, 31, 32, 70, 99])
def test_its_residual_tokens_are_exact_and_the_rest_as_stored(t):
    key, value = keys_with_outliers(100), keys_with_outliers(100, seed=2)
    layout = alt.kivi_layout(32, 32)
    stored_key, stored_value = layout.stored(key, value)

    read_key, read_value = layout.read(key, value, t)

    key_below, value_below = t // 32 * 32, max(t - 32, 0)
    assert read_key.shape == read_value.shape == (t + 1, KVH, D)
    assert torch.equal(read_key[key_below:], key[key_below : t + 1].bfloat16().float())
    assert torch.equal(read_key[:key_below], stored_key[:key_below])
    assert torch.equal(
        read_value[value_below:], value[value_below : t + 1].bfloat16().float()
    )
    assert torch.equal(read_value[:value_below], stored_value[:value_below])


@pytest.mark.parametrize(
    "layout",
    [
        alt.kivi_layout(32, 32),
        alt.kivi_layout(16, 32, rotate=True),
        alt.served_int4_layout(18),
        alt.sink_int4_layout(18, 4),
        alt.BF16,
    ],
    ids=lambda layout: layout.name,
)
def test_the_attention_is_a_loop_over_decode_steps(layout, monkeypatch):
    monkeypatch.setattr(alt, "_QUERY_CHUNK", 16)  # several query chunks
    n, heads = 75, 4
    query = torch.randn(n, heads, D, generator=torch.Generator().manual_seed(3))
    key, value = keys_with_outliers(n), keys_with_outliers(n, seed=4)
    scale = D**-0.5
    atol = 1e-5 * float(value.abs().max())

    out = alt.layout_attention(query, key, value, scale, layout)

    rotation = kernels.hadamard(D) if layout.rotate else torch.eye(D)
    q, k, v = query @ rotation, key @ rotation, value @ rotation
    for t in range(n):
        read_key, read_value = layout.read(k, v, t)  # [t+1, KVH, D]
        read_key = read_key.repeat_interleave(heads // KVH, dim=1)  # [t+1, H, D]
        read_value = read_value.repeat_interleave(heads // KVH, dim=1)
        probs = torch.softmax(torch.einsum("hd,phd->hp", q[t], read_key) * scale, -1)
        expected = torch.einsum("hp,phd->hd", probs, read_value) @ rotation.T
        # values reach ~66 (outlier channels): float32 summation order moves the
        # result by up to ~2e-6 of that (1.2e-4 on an AMX Xeon), the CPU's vector
        # width deciding how; one position read in the wrong format moves it by > 2
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=atol)


def test_the_simulated_int4_stores_what_the_served_quantizer_stores():
    key, value = keys_with_outliers(50), keys_with_outliers(50, seed=5)

    stored_key, _ = alt.served_int4_layout(18).stored(key, value)

    expected = kernels.dequantize_kv(*kernels.quantize_kv(key, "int4"), "int4")
    assert torch.equal(stored_key, expected)
    below, _ = alt.served_int4_layout(18).quantized_below(40)
    assert below[17] == 0 and below[39] == 22  # the query's newest 18 in bf16


def test_sinks_are_read_in_bf16_by_every_query():
    key, value = keys_with_outliers(60), keys_with_outliers(60, seed=6)
    layout = alt.sink_int4_layout(8, 4)
    stored_key, _ = layout.stored(key, value)

    read_key, _ = layout.read(key, value, 59)

    assert torch.equal(read_key[:4], key[:4].bfloat16().float())
    assert torch.equal(read_key[4:52], stored_key[4:52])
    assert torch.equal(read_key[52:], key[52:].bfloat16().float())
    assert alt.named_layout(layout.name) == layout


def test_gauss_levels_read_each_element_as_its_nearest_level():
    x = keys_with_outliers(40) @ kernels.hadamard(D)

    read = alt.int4_gauss_read(x)

    levels = torch.tensor(GAUSS16)
    scale = read.abs().amax(-1, keepdim=True) / levels[-1]  # the chosen scale
    on_grid = read / scale
    assert (on_grid[..., None] - levels).abs().amin(-1).max() < 1e-4
    nearest = levels[(x / scale)[..., None].sub(levels).abs().argmin(-1)] * scale
    torch.testing.assert_close(read, nearest, rtol=0, atol=1e-4)
    # Gaussian vectors (as rotated ones nearly are): ~20% less squared error than
    # the served uniform levels at the same bytes
    g = torch.randn(2000, D, generator=torch.Generator().manual_seed(1))
    served = kernels.dequantize_kv(*kernels.quantize_kv(g, "int4"), "int4")
    gauss_err = ((alt.int4_gauss_read(g) - g) ** 2).sum()
    assert gauss_err < 0.85 * ((served - g) ** 2).sum()


def test_centered_keys_read_back_plus_their_offset():
    g = torch.Generator().manual_seed(7)
    offset = torch.zeros(30, KVH, D)
    offset[..., :8] = 40.0  # a key's common part, far larger than its own
    key, value = offset + torch.randn(30, KVH, D, generator=g), keys_with_outliers(30)
    layout = alt.int4_variant_layout(4, center_keys=True)
    q = torch.randn(30, 2 * KVH, D, generator=torch.Generator().manual_seed(3))

    out = alt.layout_attention(q, key, value, 0.125, layout, offset)
    plain = alt.layout_attention(q, key, value, 0.125, layout)
    exact = alt.layout_attention(q, key, value, 0.125, alt.BF16)

    # the same layout reading the offset keys as stored: closer to exact
    assert (out - exact).abs().mean() < (plain - exact).abs().mean()
    assert alt.named_layout(layout.name) == layout
    assert alt.named_layout("sim-int4gc+w17s1") == alt.int4_variant_layout(
        17, 1, gauss=True, center_keys=True
    )


def test_with_zero_key_means_centering_reads_what_the_served_int4_reads(demo_model):
    ids = list(range(5, 45))
    zeros = [torch.zeros(2, 64) for _ in demo_model.layers]  # the demo: 2 kv heads
    assert demo_model.config.num_key_value_heads == 2

    centered = alt.layout_logprobs(
        demo_model, ids, alt.named_layout("sim-int4c+w4"), zeros
    )
    served = alt.layout_logprobs(demo_model, ids, alt.served_int4_layout(4))

    torch.testing.assert_close(centered, served, rtol=0, atol=1e-5)
    means = alt.key_means(demo_model, [ids])
    assert len(means) == len(demo_model.layers) and means[0].shape == (2, 64)
    assert means[0].abs().sum() > 0


def test_a_centering_layout_without_key_means_is_refused(demo_model):
    with pytest.raises(ValueError, match="sim-int4c\\+w18 centers keys"):
        alt.layout_logprobs(demo_model, [1, 2, 3], alt.named_layout("sim-int4c+w18"))


# ----------------------------------------------------------------------- bytes


@pytest.fixture(scope="module")
def demo_model():
    from gpuagent.engine.loader import load_model

    return load_model(bench.DEMO_MODEL_DIR)


def test_it_counts_kivis_scales_and_residual_row_in_its_bytes(demo_model):
    config = demo_model.config
    assert config.head_dim == 64

    # keys 32 + 8 (min, scale per channel per 32 tokens), values 32 + 8 (per token
    # per 32 channels), residual 32 tokens of K and V in bf16 over 2048: 4; of 256
    assert alt.kivi_layout(32, 32).bytes_ratio(config) == (80 + 4) / 256
    assert alt.kivi_layout(32, 128).bytes_ratio(config) == (80 + 16) / 256
    int4 = alt.served_int4_layout(18).bytes_ratio(config)
    assert int4 == pytest.approx(bench.amortized_bytes_ratio(config, "int4"))
    # the window that KIVI's bytes buy the served int4: (84 - 68) * 2048 / 256
    window = alt.int4_window_at_bytes(config, (80 + 4) / 256)
    assert window == 128
    assert alt.served_int4_layout(window).bytes_ratio(config) == pytest.approx(
        (80 + 4) / 256
    )
    assert kv_bytes_per_token(config, "int4") / kv_bytes_per_token(
        config, "bf16"
    ) == pytest.approx(68 / 256)
    # sinks count as window tokens; at the measured length, not a fixed 2k
    sinks = alt.sink_int4_layout(14, 4).bytes_ratio(config, 4096)
    assert sinks == pytest.approx((68 + 4 * 18 * 64 / 4096) / 256)
    # the Gaussian levels keep int4's bytes; centered keys add their float32 means
    gauss = alt.int4_variant_layout(14, 4, gauss=True)
    assert gauss.bytes_ratio(config, 4096) == sinks
    centered = alt.int4_variant_layout(14, 4, gauss=True, center_keys=True)
    assert centered.bytes_ratio(config, 4096) == pytest.approx(
        (68 + (4 * 18 + 4) * 64 / 4096) / 256
    )


# ------------------------------------------------------------------ the model


def test_on_the_demo_model_the_simulation_scores_what_the_engine_scores(demo_model):
    window = 18
    layouts = [alt.BF16, alt.served_int4_layout(window), alt.kivi_layout(32, 32)]

    int4, sim_bf16, sim_int4, kivi = bench.kv_quality(
        bench.DEMO_MODEL_DIR,
        demo_model,
        ("int4",),
        max_items=1,
        passage_tokens=80,
        simulated=layouts,
    )

    assert [r.dtype for r in (sim_bf16, sim_int4, kivi)] == [x.name for x in layouts]
    assert kivi.bytes_ratio == alt.kivi_layout(32, 32).bytes_ratio(demo_model.config)
    # nothing quantized: only float summation order differs from the engine's bf16
    assert sim_bf16.overall.mean_kld < 1e-6
    # the engine's own quantizer, rotation and window: the engine's numbers
    assert sim_int4.overall.mean_kld == pytest.approx(int4.overall.mean_kld, rel=1e-2)
    assert sim_int4.overall.same_top1 == int4.overall.same_top1
    assert kivi.overall.mean_kld > 10 * sim_bf16.overall.mean_kld
