"""The compressed-tensors checkpoint: tensor names and `quantization_config`.

For a quantized Linear `P` (HF name, e.g. `model.layers.0.mlp.down_proj`):
- int (pack-quantized): `P.weight_packed` int32 [N, K * bits / 32] (codes packed
  along the input dim, LSB first, each stored as q + 2^(bits-1)), `P.weight_scale`
  bf16 [N, K / group] ([N, 1] per channel), `P.weight_shape` int64 [2], and for
  asymmetric int4 `P.weight_zero_point` int32 packed along the output dim
  [N * bits / 32, K / group];
- fp8 (float-quantized): `P.weight` float8_e4m3fn [N, K], `P.weight_scale` [N, 1].
Everything else (embeddings, norms, unquantized heads) is stored in bf16.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuagent.compress.quantize import QuantizedWeight
from gpuagent.compress.recipes import WeightScheme
from kernels.weight_matmul import pack_int32

DENSE_DTYPE = torch.bfloat16
# Linear projections of a Llama block, by the input width they see.
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def quantized_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of Linear `name` (module docstring)."""
    n, k = qw.codes.shape
    if qw.codes.dtype == torch.float8_e4m3fn:
        return {f"{name}.weight": qw.codes, f"{name}.weight_scale": qw.scale}
    tensors = {
        f"{name}.weight_packed": pack_int32(qw.codes, qw.bits),
        f"{name}.weight_scale": qw.scale.contiguous(),
        f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if qw.zero_point is not None:
        # packed along the output dim, as compressed-tensors packs zero points
        packed = pack_int32(qw.zero_point.t().contiguous(), qw.bits)
        tensors[f"{name}.weight_zero_point"] = packed.t().contiguous()
    return tensors


def weights_args(scheme: WeightScheme, group_size: int | None) -> dict[str, Any]:
    """compressed-tensors QuantizationArgs of the weights of one config group."""
    return {
        "num_bits": scheme.bits,
        "type": scheme.kind,
        "symmetric": scheme.symmetric,
        "strategy": "group" if group_size else "channel",
        "group_size": group_size,
        "dynamic": False,
        "actorder": "weight" if scheme.act_order else None,
        "block_structure": None,
        "observer": scheme.observer,
        "observer_kwargs": {},
    }


def quantization_config(
    scheme: WeightScheme,
    group_targets: dict[int | None, list[str]],
    ignore: list[str],
    kv_cache_scheme: dict[str, Any] | None,
) -> dict[str, Any]:
    """config.json's `quantization_config`: one config group per group size, its
    targets the projections (regexes on module names) that got that size."""
    groups = {}
    for i, (group_size, targets) in enumerate(sorted(group_targets.items(), key=_key)):
        groups[f"group_{i}"] = {
            "targets": targets,
            "weights": weights_args(scheme, group_size),
            "input_activations": None,
            "output_activations": None,
            "format": scheme.compression_format,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": scheme.compression_format,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": kv_cache_scheme,
    }


def kv_cache_only_config(kv_cache_scheme: dict[str, Any]) -> dict[str, Any]:
    """config.json's `quantization_config` of dense weights with fp8 KV scales, as
    llm-compressor writes a KV-cache-only recipe: no config groups, format dense,
    the `kv_cache_scheme` that tells vLLM (and transformers) what the
    `self_attn.k_scale` / `v_scale` tensors are."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": kv_cache_scheme,
    }


def _key(item: tuple[int | None, list[str]]) -> int:
    return item[0] or 0


def projection_target(projection: str) -> str:
    """Regex target matching one projection in every layer; a routed expert's
    kind ("mlp.experts.gate_proj") matches it in every expert."""
    pattern = projection.replace(".", r"\.")
    if projection.startswith("mlp.experts."):
        pattern = pattern.replace(r"experts\.", r"experts\.\d+\.", 1)
    return "re:.*" + pattern + "$"
