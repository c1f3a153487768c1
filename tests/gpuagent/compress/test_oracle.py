"""Our compressed folders read back by code no one here wrote: the
compressed-tensors package (its config model and decompressors) and transformers."""

import json
import re

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file

from gpuagent.engine.loader import load_model
from kernels.weight_matmul import pack_int32, unpack_int32
from tests.gpuagent.compress.conftest import DEMO_MODEL

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def _scheme_for(config: QuantizationConfig, module: str):
    for scheme in config.config_groups.values():
        for target in scheme.targets:
            if target.startswith("re:") and re.match(target[3:], module):
                return scheme
    raise AssertionError(f"no config group targets {module}")


def _decompressed(folder):
    """module -> (weight decompressed by compressed-tensors, its scale)."""
    config = json.loads((folder / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    tensors = load_file(folder / "model.safetensors")
    modules = {
        name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")
    }
    out = {}
    for module in sorted(modules):
        state = {
            k.rsplit(".", 1)[1]: v
            for k, v in tensors.items()
            if k.rsplit(".", 1)[0] == module
        }
        scheme = _scheme_for(qc, module)
        out[module] = (compressor.decompress(state, scheme)["weight"], state)
    return qc, out


@pytest.mark.parametrize("name", ["w8a16", "w4a16-g128", "fp8"])
def test_it_decompresses_with_compressed_tensors_within_rounding(compressed_demo, name):
    source = load_file(DEMO_MODEL / "model.safetensors")
    qc, modules = _decompressed(compressed_demo[name])

    assert qc.ignore == ["lm_head"]
    assert len(modules) == 4 * 7  # every projection of the 4 layers, no embeddings
    for module, (weight, state) in modules.items():
        original = source[module + ".weight"].float()
        error = (weight.float() - original).abs()
        scale = state["weight_scale"].float()  # [N, groups]
        per_element = scale.repeat_interleave(original.shape[1] // scale.shape[1], 1)
        if name == "fp8":  # e4m3: 3 mantissa bits, half an ulp of 2^-3 relative
            bound = original.abs() / 16 + per_element * 2**-9
        else:  # round to nearest: half a step, plus the row/group maximum's clamp
            # when the bf16 scale rounded down (absmax / scale up to 7.5 (1 + 2^-8))
            bound = per_element * (0.5 + 2**-5)
        # compressed-tensors returns the weight in the scale's dtype (bf16)
        bound = bound + original.abs() * 2**-8
        assert (error <= bound + 1e-7).all(), module


def test_it_decompresses_asymmetric_gptq_to_what_the_engine_runs(compressed_demo):
    folder = compressed_demo["w4a16-g64-asym-gptq"]
    _, modules = _decompressed(folder)
    model = load_model(folder)  # float32: the torch reference
    served_in_bf16 = load_model(folder, dtype=torch.bfloat16)  # torch's CPU kernel

    for module, (weight, state) in modules.items():
        name = module.removeprefix("model.")
        layer = model.get_submodule(name)
        eye = torch.eye(layer.in_features)
        assert layer.cpu_weight is None
        reference_weight = layer(eye).t()  # [N, K]: W e_k for every k
        kernel_layer = served_in_bf16.get_submodule(name)
        assert kernel_layer.cpu_weight is not None
        engine_weight = kernel_layer(eye.bfloat16()).t().float()

        # compressed-tensors rounds its product to bf16 (relative 2^-9)
        torch.testing.assert_close(
            reference_weight, weight.float(), atol=1e-6, rtol=2**-8
        )
        # The CPU kernel rounds its output to bf16 too (two roundings: up to an ulp,
        # 2^-7 relative) and holds the scale s and the zero -zp * s in bf16: with
        # |q|, |zp| <= 8 that is off by at most 16 s 2^-9 where (q - zp) s cancels.
        scale = state["weight_scale"].float()  # [N, groups]
        per_element = scale.repeat_interleave(weight.shape[1] // scale.shape[1], 1)
        bound = weight.float().abs() * 2**-7 + per_element * 16 * 2**-9
        assert ((engine_weight - weight.float()).abs() <= bound + 1e-7).all(), module


def test_it_decompresses_fp8_gptq_to_what_the_engine_runs(compressed_demo):
    folder = compressed_demo["fp8-gptq"]
    _, modules = _decompressed(folder)
    model = load_model(folder)

    assert len(modules) == 4 * 7
    for module, (weight, state) in modules.items():
        assert state["weight"].dtype == torch.float8_e4m3fn, module
        layer = model.get_submodule(module.removeprefix("model."))
        engine_weight = layer(torch.eye(layer.in_features)).t()  # [N, K]
        # compressed-tensors rounds its product to bf16 (relative 2^-9)
        torch.testing.assert_close(engine_weight, weight.float(), atol=1e-6, rtol=2**-8)


def test_it_reads_mse_observer_scales_as_any_other(compressed_demo):
    folder = compressed_demo["w8a16-gptq-mse"]
    qc, modules = _decompressed(folder)
    source = load_file(DEMO_MODEL / "model.safetensors")
    model = load_model(folder)

    assert {g.weights.observer for g in qc.config_groups.values()} == {"mse"}
    shrunk = 0
    for module, (weight, state) in modules.items():
        layer = model.get_submodule(module.removeprefix("model."))
        engine_weight = layer(torch.eye(layer.in_features)).t()  # [N, K]
        # compressed-tensors rounds its product to bf16 (relative 2^-9)
        torch.testing.assert_close(engine_weight, weight.float(), atol=1e-6, rtol=2**-8)
        # scales from the source rows' range, some of them shrunk (GPTQ fixes
        # per-row scales before its updates)
        minmax = source[module + ".weight"].float().abs().amax(1, keepdim=True) / 127
        scale = state["weight_scale"].float()
        assert (scale <= minmax * (1 + 2**-8)).all(), module
        shrunk += int((scale < 0.99 * minmax).sum())
    assert shrunk > 0


def test_it_reads_signround_codes_and_scales_as_any_other(compressed_demo):
    folder = compressed_demo["w4a16-g64-signround"]
    _, modules = _decompressed(folder)
    source = load_file(DEMO_MODEL / "model.safetensors")
    model = load_model(folder)

    assert len(modules) == 4 * 7
    shrunk = negative = 0
    for module, (weight, state) in modules.items():
        layer = model.get_submodule(module.removeprefix("model."))
        engine_weight = layer(torch.eye(layer.in_features)).t()  # [N, K]
        # compressed-tensors rounds its product to bf16 (relative 2^-9)
        torch.testing.assert_close(engine_weight, weight.float(), atol=1e-6, rtol=2**-8)
        # signed full-range scales: |scale| at most the groups' absmax / 8, some
        # shrunk by the tuning, negative where the positive extreme is the larger
        original = source[module + ".weight"].float()
        groups = original.view(original.shape[0], -1, 64)
        minmax = groups.abs().amax(-1) / 8
        scale = state["weight_scale"].float()
        assert (scale.abs() <= minmax * (1 + 2**-8)).all(), module
        shrunk += int((scale.abs() < 0.99 * minmax).sum())
        negative += int((scale < 0).sum())
    assert shrunk > 0 and negative > 0


@pytest.mark.parametrize("bits", [4, 8])
def test_it_packs_bit_for_bit_like_compressed_tensors(bits):
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    codes = torch.randint(lo, hi + 1, (24, 96), generator=g, dtype=torch.int8)

    packed = pack_int32(codes, bits)

    assert torch.equal(packed, pack_to_int32(codes, bits))
    assert torch.equal(unpack_int32(packed, bits, 96), codes)
    # a zero-point row packed with padding: the columns asked for, in order
    assert torch.equal(unpack_int32(packed, bits, 90), codes[:, :90])
    assert torch.equal(unpack_from_int32(packed, bits, codes.shape), codes)


def test_it_loads_in_transformers(compressed_demo):
    from transformers import AutoModelForCausalLM

    folder = compressed_demo["w4a16-g128"]
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = load_model(folder)  # float32 activations: our torch reference
    with torch.no_grad():
        hf_logits = hf(tokens).logits
        ours = ours.forward_dense(tokens)

    torch.testing.assert_close(hf_logits, ours, atol=2e-3, rtol=0)
