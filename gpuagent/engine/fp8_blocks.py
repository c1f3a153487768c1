"""Block-scaled fp8 checkpoints, as DeepSeek-V3 and Kimi K2 are published:
`quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`, each quantized
Linear stored as `X.weight` (float8_e4m3fn [out, in]) and `X.weight_scale_inv`
(float32 [ceil(out / 128), ceil(in / 128)]), W = weight * scale_inv per block.

The engine has no block-fp8 GEMM yet: `dequantize` turns such a checkpoint into a
plain one (W in float32, cast to the model dtype by the loader), as transformers
does where it has no fp8 kernel. Anything else in the config is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

SCALE_SUFFIX = ".weight_scale_inv"
CONFIG_KEYS = {
    "quant_method",
    "fmt",
    "activation_scheme",
    "weight_block_size",
    "modules_to_not_convert",
}


class BlockFp8Error(ValueError):
    """The block-fp8 part of a checkpoint can't be read; the message says why."""


def is_block_fp8(hf_config: dict[str, Any]) -> bool:
    """Whether config.json declares DeepSeek's block-scaled fp8 weights."""
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "fp8"


def block_size(qc: dict[str, Any]) -> tuple[int, int]:
    """The (rows, columns) of one scale block; BlockFp8Error for a config this
    module doesn't read."""
    unknown = sorted(set(qc) - CONFIG_KEYS)
    if unknown:
        raise BlockFp8Error(f"quantization_config has unknown keys {unknown}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise BlockFp8Error(f"fp8 fmt {qc.get('fmt')!r} is not supported (e4m3)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise BlockFp8Error(
            f"activation_scheme {qc.get('activation_scheme')!r} is not supported "
            "(dynamic)"
        )
    size = qc.get("weight_block_size")
    if (
        not isinstance(size, list)
        or len(size) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in size)
        or min(size) < 1
    ):
        raise BlockFp8Error(
            f"weight_block_size {size!r} must be two positive integers "
            "(per-tensor fp8 is not supported)"
        )
    return size[0], size[1]


def dequantize(checkpoint: dict[str, Tensor], qc: dict[str, Any]) -> dict[str, Tensor]:
    """The checkpoint with every fp8 weight and its scale replaced by the float32
    weight; BlockFp8Error for an fp8 tensor without its scale, a scale without
    its weight, or a misshapen scale."""
    rows, cols = block_size(qc)
    out: dict[str, Tensor] = {}
    scales = {n for n in checkpoint if n.endswith(SCALE_SUFFIX)}
    for name, tensor in checkpoint.items():
        if name in scales:
            weight = name.removesuffix(SCALE_SUFFIX) + ".weight"
            if (
                weight not in checkpoint
                or checkpoint[weight].dtype != torch.float8_e4m3fn
            ):
                raise BlockFp8Error(f"{name} has no fp8 weight {weight}")
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            out[name] = tensor
            continue
        scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
        if not name.endswith(".weight") or scale_name not in scales:
            raise BlockFp8Error(f"fp8 tensor {name} has no {SCALE_SUFFIX}")
        out[name] = _dequantize_one(name, tensor, checkpoint[scale_name], rows, cols)
    return out


def _dequantize_one(
    name: str, weight: Tensor, scale: Tensor, rows: int, cols: int
) -> Tensor:
    if weight.dim() != 2:
        raise BlockFp8Error(f"fp8 tensor {name} is not a matrix")
    out_dim, in_dim = weight.shape
    want = (-(-out_dim // rows), -(-in_dim // cols))
    if tuple(scale.shape) != want:
        raise BlockFp8Error(
            f"{name}: scale shape {tuple(scale.shape)}, expected {want} for "
            f"{rows}x{cols} blocks of {tuple(weight.shape)}"
        )
    per_element = scale.float().repeat_interleave(rows, 0)[:out_dim]
    per_element = per_element.repeat_interleave(cols, 1)[:, :in_dim]
    return weight.float() * per_element
