"""The MLA latent-cache simulation (benches.mla_kv): its int8, fp8-per-token and
fp8 rows are the served caches bit for bit, a window covering every token reads the
bf16 cache, its int4 reads lie within half a step of the latent (rotated or not),
int8's and fp8's static scales are the served calibration's (or clipped, per
channel), and its bytes are counted with the scales and the window row."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import gpuagent.engine
import kernels
from gpuagent.benches import mla_kv as sim
from gpuagent.engine.kv_calibration import calibration_sequences
from gpuagent.engine.loader import load_model
from gpuagent.engine.mla import calibration_latents, latent_scales
from gpuagent.evaluate.evalsets import load_heldout_passages
from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.regression import exact_position_stats

MOE_DIR = Path(gpuagent.engine.__file__).parent / "moe_demo_model"
TEXT = (
    "The cache keeps one compressed latent per token and layer, and a small RoPE "
    "key beside it. Quantizing it saves memory; whether the model still predicts "
    "the same next tokens is what this test and the bench measure. " * 3
)


@pytest.fixture(scope="module")
def model():
    return load_model(MOE_DIR, dtype=torch.float32, device="cpu")


def logprobs(model, kv_dtype, ids, layout=None, scales=None):
    side = EngineModel(MOE_DIR, kv_dtype, model=model)
    if layout is None:
        return list(side.logprobs_chunks(ids))
    with sim.simulated(model, layout, scales):
        return list(side.logprobs_chunks(ids))


def layout_named(name):
    (layout,) = [x for x in sim.LAYOUTS if x.name == name]
    return layout


def calibration_ids(model):
    tokenizer = EngineModel(MOE_DIR, "bf16", model=model).engine.tokenizer
    return calibration_sequences(tokenizer)


def served_scales(model, rotate=False):
    return latent_scales(model, calibration_ids(model), rotate)


def bench_scales(model, layout):
    latents = calibration_latents(model, calibration_ids(model))
    return sim.static_scales(latents, model.config.kv_lora_rank, layout)


@pytest.mark.parametrize(
    ("kv_dtype", "name"),
    [
        ("int8", "sim-int8s/pe8"),
        ("fp8-per-token", "sim-fp8pt"),
        ("fp8", "sim-fp8/pe8"),
    ],
)
def test_a_row_is_its_served_cache_bit_for_bit(model, kv_dtype, name):
    reference = EngineModel(MOE_DIR, "bf16", model=model)
    ids = reference.encode(TEXT)
    ref = list(reference.logprobs_chunks(ids))
    served = logprobs(model, kv_dtype, ids)
    layout = layout_named(name)
    scales = bench_scales(model, layout) if layout.static else None
    simulated = logprobs(model, sim.SIM_CACHE_DTYPE, ids, layout, scales)
    # the bench's served row stores what this simulation stores
    assert dataclasses.replace(sim.SERVED[kv_dtype], name=name) == layout
    assert len(ids) > 100
    for a, b in zip(served, simulated, strict=True):
        assert torch.equal(a, b)
    served_stats = exact_position_stats(ref, served, ids)
    simulated_stats = exact_position_stats(ref, simulated, ids)
    assert served_stats.kld.mean() > 0  # the cache differs from bf16 at all
    assert simulated_stats.kld.mean() == served_stats.kld.mean()
    assert (simulated_stats.same_top1 == served_stats.same_top1).all()


def test_a_window_over_every_token_reads_the_bf16_cache(model):
    reference = EngineModel(MOE_DIR, "bf16", model=model)
    ids = reference.encode(TEXT)
    ref = list(reference.logprobs_chunks(ids))
    everything = sim.LatentLayout("all-bf16", "int4", rotate=True, window=len(ids))
    windowed = logprobs(model, sim.SIM_CACHE_DTYPE, ids, everything)
    stats = exact_position_stats(ref, windowed, ids)
    # only float summation order differs (absorbed vs naive form)
    assert stats.kld.max() < 1e-6
    int4 = logprobs(model, sim.SIM_CACHE_DTYPE, ids, layout_named("sim-int4r"))
    assert exact_position_stats(ref, int4, ids).kld.mean() > 1e-4


@pytest.mark.parametrize("rotate", [False, True])
def test_int4_reads_lie_within_half_a_step_of_the_latent(rotate):
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(5, 80, generator=g) * torch.linspace(0.1, 4, 80)
    layout = sim.LatentLayout("x", "int4", rotate=rotate)
    read = layout.stored(latents, 64)
    pairs = zip(latents.split((64, 16), -1), read.split((64, 16), -1), strict=True)
    for part, got in pairs:
        rotation = kernels.hadamard(part.shape[-1])
        x, y = (part @ rotation, got @ rotation) if rotate else (part, got)
        _, scale = kernels.quantize_kv(x, "int4")
        bound = scale.float()[:, None] / 2 * (1 + 1e-4) + 1e-5
        # the outer levels take what lies beyond them: check the inner values
        inner = x.abs() <= 7.5 * scale.float()[:, None]
        assert ((x - y).abs() <= bound)[inner].all()
        assert not torch.equal(x, y)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_the_static_scales_are_the_served_calibration(model, kv_dtype):
    engine = EngineModel(MOE_DIR, kv_dtype, model=model).engine
    served = torch.stack([cache.key_scale for cache in engine.kv.kv_caches])
    layout = sim.SERVED[kv_dtype]
    scales = bench_scales(model, layout)
    # the latent's static scale on each of its channels; the RoPE key is int8,
    # scaled per token (ones in the static scales)
    assert torch.equal(scales[:, :64], served.expand(-1, 64))
    assert torch.equal(scales[:, 64:], torch.ones_like(scales[:, 64:]))
    rotated = bench_scales(model, dataclasses.replace(layout, rotate=True))
    assert not torch.equal(rotated[:, :1], served)
    clipped = bench_scales(model, dataclasses.replace(layout, clip=0.999))
    # a quantile lies at or below the absmax (layer 0's top values repeat)
    assert (clipped[:, :64] <= served).all() and (clipped[:, :64] < served).any()
    per_channel = bench_scales(model, dataclasses.replace(layout, per_channel=True))
    assert torch.equal(per_channel[:, :64].amax(-1, keepdim=True), served)
    assert (per_channel[:, :64] < served).any()
    if kv_dtype == "fp8":  # the calibration's own function, per part
        assert torch.equal(served_scales(model)[:, :1], served)


@pytest.mark.parametrize("rotate", [False, True])
def test_fp8_reads_lie_within_e4m3_rounding_of_the_latent(rotate):
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(5, 80, generator=g) * torch.linspace(0.1, 4, 80)
    parts = latents.split((64, 16), -1)
    basis = [kernels.hadamard(p.shape[-1]) if rotate else None for p in parts]
    rotated = [p if h is None else p @ h for p, h in zip(parts, basis, strict=True)]
    scales = torch.stack([x.abs().amax() for x in rotated]) / sim.FP8_MAX  # no clip
    layout = sim.LatentLayout("x", "fp8", rotate=rotate)
    read = layout.stored(latents, 64, scales).split((64, 16), -1)
    for x, got, h, scale in zip(rotated, read, basis, scales, strict=True):
        y = got if h is None else got @ h
        # e4m3 keeps 3 mantissa bits: half a step is at most 1/16 of the value,
        # and below 2^-6 * scale (subnormals) a fixed 2^-10 * scale
        bound = x.abs() / 16 + 2**-10 * scale
        assert ((x - y).abs() <= bound * (1 + 1e-4) + 1e-6).all()
        assert not torch.equal(x, y)
    with pytest.raises(ValueError, match="static scales"):
        sim.LatentLayout("x", "fp8").stored(latents, 64)


@pytest.mark.parametrize("rotate", [False, True])
def test_static_int8_reads_lie_within_half_a_step_or_at_the_outer_level(rotate):
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(5, 80, generator=g) * torch.linspace(0.1, 4, 80)
    c = latents[:, :64] @ kernels.hadamard(64) if rotate else latents[:, :64]
    scale = c.abs().amax() / sim.INT8_MAX * 0.8  # the largest values clip
    scales = torch.cat((scale.expand(64), torch.ones(16)))
    layout = sim.LatentLayout("x", "int8-static", rotate=rotate, pe_dtype="int8")

    read = layout.stored(latents, 64, scales)

    got = read[:, :64] @ kernels.hadamard(64) if rotate else read[:, :64]
    inside = c.abs() <= 127 * scale
    tol = 1e-4 * scale if rotate else 0  # the rotation's float rounding
    assert ((got - c).abs()[inside] <= scale / 2 * (1 + 1e-4) + tol).all()
    assert ((got.abs() - 127 * scale).abs()[~inside] <= tol + 1e-6).all()
    assert (~inside).any() and inside.any()
    pe = latents[:, 64:] @ kernels.hadamard(16) if rotate else latents[:, 64:]
    codes, pe_scale = kernels.quantize_kv(pe, "int8")  # per token, in its basis
    pe_read = read[:, 64:] @ kernels.hadamard(16) if rotate else read[:, 64:]
    want = kernels.dequantize_kv(codes, pe_scale, "int8")
    torch.testing.assert_close(pe_read, want, atol=1e-5 if rotate else 0, rtol=0)
    with pytest.raises(ValueError, match="static scales"):
        layout.stored(latents, 64)


def test_a_bf16_rope_key_is_read_as_bf16_and_c_as_its_dtype():
    latents = torch.randn(3, 80, generator=torch.Generator().manual_seed(1))
    layout = sim.LatentLayout("x", "fp8-per-token", pe_dtype="bf16")
    read = layout.stored(latents, 64)
    assert torch.equal(read[:, 64:], latents[:, 64:].to(torch.bfloat16).float())
    plain = sim.LatentLayout("y", "fp8-per-token").stored(latents, 64)
    assert torch.equal(read[:, :64], plain[:, :64])
    as_int8 = sim.LatentLayout("z", "fp8-per-token", pe_dtype="int8")
    codes, scale = kernels.quantize_kv(latents[:, 64:], "int8")
    expect = kernels.dequantize_kv(codes, scale, "int8")
    assert torch.equal(as_int8.stored(latents, 64)[:, 64:], expect)


def test_bytes_count_codes_scales_and_the_window_row(model):
    config = model.config  # 4 layers, rank 64 + rope 16: bf16 160 bytes / layer
    assert sim.LatentLayout("a", "int4").bytes_ratio(config) == 44 / 160
    assert sim.LatentLayout("b", "int8").bytes_ratio(config) == 84 / 160
    assert sim.LatentLayout("p", "fp8-per-token").bytes_ratio(config) == 84 / 160
    # static fp8: codes only, two float32 scales per layer spread over 2048 tokens
    static = sim.LatentLayout("s", "fp8").bytes_ratio(config, 2048)
    assert static == pytest.approx((80 + 2 * 4 / 2048) / 160)
    # the RoPE key as bf16 (32 bytes), or int8 codes and a float16 scale (18)
    pe16 = sim.LatentLayout("t", "fp8", pe_dtype="bf16").bytes_ratio(config, 2048)
    assert pe16 == pytest.approx((64 + 32 + 4 / 2048) / 160)
    pe8 = sim.LatentLayout("u", "fp8", window=16, pe_dtype="int8")
    assert pe8.bytes_ratio(config, 2048) == pytest.approx(
        (64 + 18 + (16 * 160 + 4) / 2048) / 160
    )
    # static int8 on c: codes and a float32 scale per layer, or per channel
    int8s = sim.LatentLayout("v", "int8-static", pe_dtype="int8")
    assert int8s.bytes_ratio(config, 2048) == pytest.approx((82 + 4 / 2048) / 160)
    assert int8s.family == "int8"
    per_channel = dataclasses.replace(int8s, per_channel=True)
    assert per_channel.bytes_ratio(config, 2048) == pytest.approx(
        (82 + 64 * 4 / 2048) / 160
    )
    windowed = sim.LatentLayout("c", "int4", window=17, sinks=1)
    assert windowed.bytes_ratio(config, 2048) == pytest.approx(
        (44 + 18 * 160 / 2048) / 160
    )


def test_the_simulation_refuses_a_cache_that_is_not_exact(model):
    reference = EngineModel(MOE_DIR, "bf16", model=model)
    ids = reference.encode(TEXT)[:20]
    with pytest.raises(ValueError, match="fp32 cache"):
        logprobs(model, "bf16", ids, layout_named("sim-int4"))
    # the swap is undone after the block, also on an error
    assert all("forward" not in vars(m) for m in model.modules())


def test_the_heldout_passages_are_each_cut_to_the_model_length(model):
    reference = EngineModel(MOE_DIR, "bf16", model=model)

    ids_list = sim.heldout_ids(reference)

    assert len(ids_list) == len(load_heldout_passages()) >= 3
    assert all(len(ids) == reference.max_model_len for ids in ids_list)
    # what the bench scores fits the evaluation cache as a whole
    assert len(list(reference.logprobs_chunks(ids_list[0]))) > 0
