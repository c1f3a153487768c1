"""Round-to-nearest quantization of one Linear weight, and the int32 packing of the
compressed-tensors "pack-quantized" layout.

Conventions (those of compressed-tensors' min-max observer, so its `dequantize`
reads our tensors back): symmetric int codes q = round(w / scale) with scale =
absmax / 7.5 (int4, codes [-8, 7]) or absmax / 127 (int8, codes [-127, 127]);
asymmetric int4: scale = (max - min) / 15 over a range that includes 0, zero point
zp = -8 - round(min / scale), q = round(w / scale) + zp in [-8, 7], read back as
(q - zp) * scale. fp8: e4m3fn values of w / scale with scale = absmax / 448 per
output channel. Scales are rounded to the checkpoint's scale dtype (bf16) before
the codes are computed, so the codes fit the scales stored.

The "mse" observer (a recipe option for int formats) takes each group's range
shrunk by the factor in MSE_SHRINKS (1 down to 0.8) whose round-to-nearest codes
leave the least squared error, each input channel's error weighted by its
importance (GPTQ: the Hessian's diagonal, the calibration inputs' mean square;
otherwise 1), as llm-compressor's MSE observer does for its shrink grid. Clipping
a few large weights buys a finer step for all the others; the read-back formula
is unchanged, so compressed-tensors and the engine read such scales as any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpuagent.compress.recipes import WeightScheme

SCALE_DTYPE = torch.bfloat16
FP8_MAX = 448.0
_TINY = 1e-10
# the "mse" observer's candidate shrinks of a group's range: 1, 0.995, ..., 0.8
MSE_SHRINKS = tuple(1 - 0.005 * i for i in range(41))


@dataclass
class QuantizedWeight:
    """One Linear's weight [N, K] quantized.

    `codes`: int8 [N, K] integer codes, or float8_e4m3fn [N, K] for fp8;
    `scale`: [N, K / group] (or [N, 1]) in SCALE_DTYPE; `zero_point`: int8 like
    scale, asymmetric int4 only; `group_size`: None for one scale per row."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    bits: int
    group_size: int | None

    def dequantize(self) -> torch.Tensor:
        """Float32 W [N, K]."""
        n, k = self.codes.shape
        groups = k // (self.group_size or k)
        q = self.codes.float().view(n, groups, k // groups)
        if self.zero_point is not None:
            q = q - self.zero_point.float()[..., None]
        return (q * self.scale.float()[..., None]).view(n, k)


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Smallest and largest integer code."""
    if bits == 8 and symmetric:
        return -127, 127
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def group_params(
    w: torch.Tensor,
    bits: int,
    symmetric: bool,
    observer: str = "minmax",
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale [..., 1] float32, zero_point [..., 1] float32 or None) for the values
    along the last dim of `w` (one group per row of the view). `observer` "mse":
    the least-error shrink of each group's range (module docstring), errors
    weighted by `importance` (broadcast against `w`; None: all 1)."""
    if observer not in ("minmax", "mse"):
        raise ValueError(f"unknown observer {observer!r}")
    if symmetric:
        extent = (w.abs().amax(dim=-1, keepdim=True),)
    else:
        extent = (
            w.amin(dim=-1, keepdim=True).clamp(max=0),
            w.amax(dim=-1, keepdim=True).clamp(min=0),
        )
    if observer == "minmax":
        return _range_params(extent, bits, symmetric, 1.0)
    best = best_error = None
    error = torch.empty_like(w)  # one buffer for the 41 candidates
    for shrink in MSE_SHRINKS:
        scale, zero_point = _range_params(extent, bits, symmetric, shrink)
        # (dequantized - w)^2 in place on the codes, read back as QuantizedWeight does
        quantize_values(w, scale, zero_point, bits, symmetric, out=error)
        if zero_point is not None:
            error.sub_(zero_point)
        error.mul_(scale).sub_(w).square_()
        if importance is not None:
            error.mul_(importance)
        total = error.sum(dim=-1, keepdim=True)
        if best is None:
            best, best_error = (scale, zero_point), total
            continue
        better = total < best_error
        best_error = torch.where(better, total, best_error)
        best = (
            torch.where(better, scale, best[0]),
            None if zero_point is None else torch.where(better, zero_point, best[1]),
        )
    return best


def _range_params(
    extent: tuple[torch.Tensor, ...], bits: int, symmetric: bool, shrink: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # min-max parameters of the range, (absmax,) or (min, max), scaled by `shrink`
    lo, hi = code_range(bits, symmetric)
    if symmetric:
        divisor = 7.5 if bits == 4 else float(hi)
        return stored_scale(extent[0] * shrink / divisor), None
    wmin, wmax = (e * shrink for e in extent)
    scale = stored_scale((wmax - wmin) / (hi - lo))
    zero_point = (lo - torch.round(wmin / scale)).clamp(lo, hi)
    return scale, zero_point


def stored_scale(scale: torch.Tensor) -> torch.Tensor:
    # the scale as the checkpoint will hold it, never 0 (an all-zero group)
    return scale.clamp_min(_TINY).to(SCALE_DTYPE).float().clamp_min(_TINY)


def quantize_values(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    symmetric: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Integer codes (float32 holding integers) of w for the given parameters,
    written into `out` when given (a float32 tensor of the result's shape)."""
    lo, hi = code_range(bits, symmetric)
    q = torch.div(w, scale, out=out).round_()  # the rest in place
    if zero_point is not None:
        q.add_(zero_point)
    return q.clamp_(lo, hi)


def fp8_scale(w: torch.Tensor) -> torch.Tensor:
    """Per output channel fp8 scale [..., N, 1] float32 of w [..., N, K], as
    stored."""
    return stored_scale(w.abs().amax(dim=-1, keepdim=True) / FP8_MAX)


def fp8_values(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The e4m3 values (float32, each exactly an e4m3fn number) nearest w / scale."""
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn).float()


def quantize_rtn(w: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight:
    """Round-to-nearest quantization of w [N, K] under `scheme`."""
    w = w.detach().float()
    n, k = w.shape
    if scheme.kind == "float":
        scale = fp8_scale(w)  # [N, 1]
        codes = fp8_values(w, scale).to(torch.float8_e4m3fn)
        return QuantizedWeight(codes, scale.to(SCALE_DTYPE), None, 8, None)
    group = scheme.group_size_for(k) or k
    groups = w.view(n, k // group, group)
    scale, zero_point = group_params(
        groups, scheme.bits, scheme.symmetric, scheme.observer
    )
    q = quantize_values(groups, scale, zero_point, scheme.bits, scheme.symmetric)
    return QuantizedWeight(
        codes=q.view(n, k).to(torch.int8),
        scale=scale[..., 0].to(SCALE_DTYPE),
        zero_point=None if zero_point is None else zero_point[..., 0].to(torch.int8),
        bits=scheme.bits,
        group_size=scheme.group_size_for(k),
    )
