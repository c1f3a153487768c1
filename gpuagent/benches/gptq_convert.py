"""Convert a GPTQ-layout int4 checkpoint (what AutoRound's `auto_gptq` export and
AutoGPTQ write) into the compressed-tensors pack-quantized layout the engine loads
(gpuagent.compress.checkpoint), so that a peer's weights run through the same
engine and evaluator as ours.

GPTQ layout, per Linear `P` with weight [N, K] and group g:
- `P.qweight` int32 [K / 8, N]: unsigned 4-bit codes u in [0, 15] packed along the
  input dim, least significant nibble first;
- `P.qzeros` int32 [K / g, N / 8]: zero points packed along the output dim, stored
  minus one (AutoGPTQ's "v1" convention: stored 7 means zero point 8);
- `P.scales` fp16 [K / g, N]; `P.g_idx` int32 [K] (group of each input channel);
- W[n, k] = scales[g_idx[k], n] * (u[k, n] - zp[g_idx[k], n]).

compressed-tensors stores q = u - 8 (packed as q + 8: the same nibbles, so
`weight_packed` is `qweight` transposed) and, for asymmetric groups, the zero
point zp - 8; a symmetric checkpoint has zp = 8 everywhere and no zero point
tensor. Scales keep their dtype (fp16 from AutoRound; the engine takes any float).
Refused, naming the tensor: act-order `g_idx` (not k // g), a group size the
engine's kernels don't take, zero points other than 8 when the conversion is
asked to be symmetric, and any tensor of a quantized Linear left over.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gpuagent.compress.checkpoint import (
    DENSE_DTYPE,
    PROJECTIONS,
    projection_target,
    quantization_config,
)
from gpuagent.compress.recipes import weight_scheme
from kernels.weight_matmul import pack_int32, unpack_int32

GROUP_SIZES = (32, 64, 128)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
_GPTQ_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


class ConvertError(ValueError):
    """A GPTQ checkpoint this converter does not take; the message names why."""


def convert_linear(
    name: str, p: dict[str, torch.Tensor], symmetric: bool
) -> tuple[dict[str, torch.Tensor], int]:
    """The compressed-tensors tensors of GPTQ Linear `name` (`p`: its qweight,
    qzeros, scales and optional g_idx) and its group size."""
    qweight, qzeros, scales = p["qweight"], p["qzeros"], p["scales"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    if scales.shape[1] != n or k % groups:
        raise ConvertError(f"{name}: scales {tuple(scales.shape)} don't fit [*, {n}]")
    group = k // groups
    if group not in GROUP_SIZES:
        raise ConvertError(f"{name}: group size {group} is not one of {GROUP_SIZES}")
    if "g_idx" in p and not torch.equal(p["g_idx"].long(), torch.arange(k) // group):
        raise ConvertError(f"{name}: g_idx is not k // {group} (act-order)")
    packed = qweight.t().contiguous()  # [N, K / 8]: same nibbles as q + 8
    zp = unpack_int32(qzeros, 4, n).long() + 8 + 1  # [G, N] true zero points
    tensors = {
        f"{name}.weight_packed": packed,
        f"{name}.weight_scale": scales.t().contiguous(),
        f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if symmetric:
        if not bool((zp == 8).all()):
            values = sorted(set(zp.unique().tolist()))
            raise ConvertError(
                f"{name}: zero points {values[:8]} in a symmetric checkpoint (8 "
                "expected; another zero-point convention?)"
            )
    else:
        signed = (zp - 8).to(torch.int8)  # [G, N]
        tensors[f"{name}.weight_zero_point"] = pack_int32(signed, 4).t().contiguous()
    return tensors, group


def dequantize_gptq(p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 W [N, K] of one GPTQ Linear (the layout in the module docstring),
    computed straight from its tensors: the reference the converter is tested on."""
    qweight, qzeros, scales = p["qweight"], p["qzeros"], p["scales"]
    shifts = 4 * torch.arange(8)
    u = (qweight.long()[:, None, :] >> shifts[None, :, None]) & 15  # [K/8, 8, N]
    u = u.reshape(-1, qweight.shape[1])  # [K, N]
    z = (qzeros.long()[:, :, None] >> shifts) & 15  # [G, N/8, 8]
    z = z.reshape(qzeros.shape[0], -1) + 1  # [G, N]
    g_idx = p.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(u.shape[0]) // (u.shape[0] // scales.shape[0])
    g_idx = g_idx.long()
    return ((u - z[g_idx]).float() * scales.float()[g_idx]).t().contiguous()


def convert(src: Path, dst: Path, symmetric: bool, tokenizer_dir: Path) -> dict:
    """Write `src` (a GPTQ-layout folder: config.json, *.safetensors) to `dst` in
    the compressed-tensors layout; tokenizer files from `tokenizer_dir`. Returns
    the group size of each converted Linear. `dst` must not exist."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise ConvertError(f"{dst} already exists")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    if not state:
        raise ConvertError(f"{src} holds no *.safetensors")
    names = sorted({k[: -len(".qweight")] for k in state if k.endswith(".qweight")})
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, int] = {}
    for name in names:
        p = {s[1:]: state.pop(name + s) for s in _GPTQ_SUFFIXES if name + s in state}
        missing = {"qweight", "qzeros", "scales"} - set(p)
        if missing:
            raise ConvertError(f"{name} lacks {sorted(missing)}")
        if name + ".bias" in state:
            raise ConvertError(f"{name}.bias: Linear biases are not supported")
        tensors, groups[name] = convert_linear(name, p, symmetric)
        out.update(tensors)
    for key, value in state.items():
        if key.endswith(_GPTQ_SUFFIXES):
            raise ConvertError(f"{key} without its Linear's qweight")
        out[key] = value.to(DENSE_DTYPE) if value.is_floating_point() else value
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    by_group: dict[int, list[str]] = {}
    for proj in PROJECTIONS:
        sizes = {g for n, g in groups.items() if n.endswith("." + proj)}
        if len(sizes) > 1:
            raise ConvertError(f"{proj}: group sizes {sorted(sizes)} differ by layer")
        if sizes:
            by_group.setdefault(sizes.pop(), []).append(projection_target(proj))
    unknown = [n for n in names if not n.endswith(tuple("." + p for p in PROJECTIONS))]
    if unknown:
        raise ConvertError(f"quantized Linears other than a block's: {unknown[:4]}")
    largest = max(by_group)
    scheme = weight_scheme(
        {
            "weights": f"w4a16-g{largest}",
            "symmetric": symmetric,
            "kv_cache_dtype": "bf16",
        }
    )
    config["quantization_config"] = quantization_config(scheme, by_group, [], None)
    config["torch_dtype"] = "bfloat16"
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(out, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / f).exists():
            shutil.copy(Path(tokenizer_dir) / f, tmp / f)
    tmp.rename(dst)
    return groups
