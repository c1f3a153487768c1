"""int4 with the 16 Lloyd-Max levels of a unit Gaussian (the "int4c" KV layout's
quantizer, issue 33 item 4): the served int4's bytes (D/2 code bytes, element 2j
in the low nibble of byte j, and one float16 scale per head vector), but code u
reads GAUSS16[u] * scale instead of (u - 7.5) * scale.

A rotated head vector is near Gaussian, and these levels are the least squared
error 4-bit levels for a Gaussian (0.0095 sigma^2 vs 0.0115 for the best uniform
ones; Max 1960). The writer searches the scale as int4 v2 does: absmax / 2.7326 * f
for f in `INT4_SCALE_FACTORS` (cast to float16, floored at 2^-14), the one with
the least squared error (the first on a tie), each code the nearest level.

Exactly what `gpuagent.benches.kv_alternatives` simulated (its `int4_gauss_read`
is `dequantize_gauss(*quantize_gauss(x))`). The writer is torch only; the paged
attention kernels read the codes with `gauss_level`.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton
from kernels.kv_quant import INT4_SCALE_FACTORS

_GAUSS16_HALF = (0.1284, 0.3881, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326)
GAUSS16 = (*(-x for x in reversed(_GAUSS16_HALF)), *_GAUSS16_HALF)
_SCALE_MIN = 2.0**-14  # the smallest normal float16: a constant vector's scale
# The eight magnitudes as Triton constants: `gauss_level`'s table in registers.
_G0, _G1, _G2, _G3, _G4, _G5, _G6, _G7 = (tl.constexpr(x) for x in _GAUSS16_HALF)


def _levels(device: torch.device) -> torch.Tensor:
    return torch.tensor(GAUSS16, device=device)


def quantize_gauss(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head vectors x [..., D] (D even) -> (packed codes uint8 [..., D/2], scale
    float16 [...]), as the module docstring says."""
    if x.shape[-1] % 2:
        raise ValueError(f"int4 needs an even head_dim, got {x.shape[-1]}")
    x32 = x.float()
    levels = _levels(x.device)
    bounds = (levels[1:] + levels[:-1]) / 2  # nearest level, as bucketize bounds
    absmax = x32.abs().amax(-1, keepdim=True)
    best_codes = best_scale = best_err = None
    for factor in INT4_SCALE_FACTORS:
        scale = (absmax / GAUSS16[-1] * factor).clamp_min(_SCALE_MIN).half()
        codes = torch.bucketize(x32 / scale.float(), bounds)
        err = ((x32 - levels[codes] * scale.float()) ** 2).sum(-1, keepdim=True)
        if best_err is None:
            best_codes, best_scale, best_err = codes, scale, err
            continue
        better = err < best_err
        best_codes = torch.where(better, codes, best_codes)
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    pairs = best_codes.to(torch.uint8).unflatten(-1, (-1, 2))
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed, best_scale.squeeze(-1)


def dequantize_gauss(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_gauss`: float32 [..., D]."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    return _levels(packed.device)[codes] * scale.float().unsqueeze(-1)


@triton.jit
def gauss_level(code):
    """GAUSS16[code] float32 for int32 codes 0..15, without a memory table: codes
    8..15 read +half[code - 8], codes 0..7 read -half[7 - code], the magnitude
    picked by a select tree on its index's three bits."""
    up = code >= 8
    m = tl.where(up, code - 8, 7 - code)
    b0 = (m & 1) != 0
    b1 = (m & 2) != 0
    low = tl.where(b1, tl.where(b0, _G3, _G2), tl.where(b0, _G1, _G0))
    high = tl.where(b1, tl.where(b0, _G7, _G6), tl.where(b0, _G5, _G4))
    mag = tl.where((m & 4) != 0, high, low).to(tl.float32)
    return tl.where(up, mag, -mag)
