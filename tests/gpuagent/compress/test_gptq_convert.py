"""The GPTQ-layout -> compressed-tensors converter (gpuagent.benches.gptq_convert)
on the demo model: a GPTQ folder built here bit by bit (real safetensors), converted,
then loaded by the engine and by compressed-tensors' own decompressor; every
projection's weight must be what the GPTQ tensors say."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches.gptq_convert import ConvertError, convert, dequantize_gptq
from gpuagent.compress.checkpoint import PROJECTIONS
from gpuagent.engine.loader import load_model
from tests.gpuagent.compress.test_oracle import _decompressed

GROUP = 64


def _pack_along_dim0(u: torch.Tensor) -> torch.Tensor:
    """Unsigned nibbles u [R, C] -> int32 [R / 8, C], row 8i + j in bits 4j..4j+3."""
    words = torch.zeros(u.shape[0] // 8, u.shape[1], dtype=torch.int64)
    for j in range(8):
        words |= u[j::8].long() << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_folder(tmp_path, symmetric: bool):
    """The demo model with every projection in the GPTQ layout (zp stored - 1);
    returns the folder and each projection's intended float weight [N, K]."""
    state = load_file(DEMO_MODEL_DIR / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    expected = {}
    for key in [
        k for k in state if k.endswith(tuple(p + ".weight" for p in PROJECTIONS))
    ]:
        name = key.removesuffix(".weight")
        w = state.pop(key).float()  # [N, K]
        n, k = w.shape
        g = w.view(n, k // GROUP, GROUP)
        if symmetric:
            zp = torch.full((n, k // GROUP), 8)
            scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-6).half()
        else:
            zp = torch.randint(4, 12, (n, k // GROUP), generator=gen)
            scale = ((g.amax(-1) - g.amin(-1)) / 15).clamp(min=1e-6).half()
        u = (g / scale.float()[..., None]).round() + zp[..., None]
        u = u.clamp(0, 15).long().view(n, k)
        expected[name] = (
            (u.view(n, -1, GROUP) - zp[..., None]) * scale.float()[..., None]
        ).view(n, k)
        state[name + ".qweight"] = _pack_along_dim0(u.t())
        # qzeros packs along the output dim: [G, N / 8]
        state[name + ".qzeros"] = _pack_along_dim0(zp - 1).t().contiguous()
        state[name + ".scales"] = scale.t().contiguous()
        state[name + ".g_idx"] = (torch.arange(k) // GROUP).int()
    src = tmp_path / "gptq"
    src.mkdir()
    save_file(state, src / "model.safetensors")
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    return src, expected


@pytest.mark.parametrize("symmetric", [True, False])
def test_converted_folder_holds_the_gptq_weights(tmp_path, symmetric):
    src, expected = _gptq_folder(tmp_path, symmetric)
    gptq = load_file(src / "model.safetensors")
    dst = tmp_path / "ct"

    groups = convert(src, dst, symmetric, DEMO_MODEL_DIR)

    assert set(groups) == set(expected) and set(groups.values()) == {GROUP}
    model = load_model(dst)
    for name, weight in expected.items():
        p = {s: gptq[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        torch.testing.assert_close(dequantize_gptq(p), weight, rtol=0, atol=0)
        layer = model.get_submodule(name.removeprefix("model."))
        with torch.no_grad():
            engine_weight = layer(torch.eye(layer.in_features)).t()
        torch.testing.assert_close(engine_weight, weight, rtol=1e-5, atol=1e-6)


def test_compressed_tensors_reads_the_converted_asymmetric_folder(tmp_path):
    src, expected = _gptq_folder(tmp_path, symmetric=False)
    dst = tmp_path / "ct"
    convert(src, dst, False, DEMO_MODEL_DIR)

    qc, modules = _decompressed(dst)

    assert set(modules) == set(expected)
    assert {g.weights.symmetric for g in qc.config_groups.values()} == {False}
    for name, weight in expected.items():
        # compressed-tensors rounds its product to the scale dtype (fp16)
        torch.testing.assert_close(
            modules[name][0].float(), weight, rtol=2**-10, atol=1e-6
        )


def test_a_symmetric_conversion_refuses_other_zero_points(tmp_path):
    src, _ = _gptq_folder(tmp_path, symmetric=False)
    with pytest.raises(ConvertError, match="zero points .* symmetric checkpoint"):
        convert(src, tmp_path / "ct", True, DEMO_MODEL_DIR)
    assert not (tmp_path / "ct").exists()
