"""The int4 MLA latent simulation (benches.mla_int4): its int8 row is the served
int8 latent cache bit for bit, a window covering every token reads the bf16 cache,
its int4 reads lie within half a step of the latent (rotated or not), and its bytes
are counted with the scales and the window row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpuagent.engine
import kernels
from gpuagent.benches import mla_int4 as sim
from gpuagent.engine.loader import load_model
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


def logprobs(model, kv_dtype, ids, layout=None):
    side = EngineModel(MOE_DIR, kv_dtype, model=model)
    if layout is None:
        return list(side.logprobs_chunks(ids))
    with sim.simulated(model, layout):
        return list(side.logprobs_chunks(ids))


def test_the_int8_row_is_the_served_int8_cache_bit_for_bit(model):
    reference = EngineModel(MOE_DIR, "bf16", model=model)
    ids = reference.encode(TEXT)
    ref = list(reference.logprobs_chunks(ids))
    served = logprobs(model, "int8", ids)
    simulated = logprobs(model, sim.SIM_CACHE_DTYPE, ids, sim.LAYOUTS[0])
    assert sim.LAYOUTS[0].dtype == "int8" and len(ids) > 100
    for a, b in zip(served, simulated, strict=True):
        assert torch.equal(a, b)
    served_stats = exact_position_stats(ref, served, ids)
    simulated_stats = exact_position_stats(ref, simulated, ids)
    assert served_stats.kld.mean() > 0  # int8 differs from bf16 at all
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
    int4 = logprobs(model, sim.SIM_CACHE_DTYPE, ids, sim.LAYOUTS[2])
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


def test_bytes_count_codes_scales_and_the_window_row(model):
    config = model.config  # 4 layers, rank 64 + rope 16: bf16 160 bytes / layer
    assert sim.LatentLayout("a", "int4").bytes_ratio(config) == 44 / 160
    assert sim.LatentLayout("b", "int8").bytes_ratio(config) == 84 / 160
    windowed = sim.LatentLayout("c", "int4", window=17, sinks=1)
    assert windowed.bytes_ratio(config, 2048) == pytest.approx(
        (44 + 18 * 160 / 2048) / 160
    )


def test_the_simulation_refuses_a_cache_that_is_not_exact(model):
    reference = EngineModel(MOE_DIR, "bf16", model=model)
    ids = reference.encode(TEXT)[:20]
    with pytest.raises(ValueError, match="fp32 cache"):
        logprobs(model, "bf16", ids, sim.LAYOUTS[1])
    # the swap is undone after the block, also on an error
    assert all("forward" not in vars(m) for m in model.modules())
