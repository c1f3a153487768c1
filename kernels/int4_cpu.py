"""The fused int4 weight-only matmul for a few rows of float32 activations on a CPU
(`_int4_cpu.c`, compiled by `pip install`): what `weight_matmul.weight_int4_matmul`
runs at decode for a float32 model on a CPU instead of the torch reference, which
dequantizes the whole weight to float32 on every call. Codes and scales are used
exactly and products and sums are float32, as in the reference; the sums are ordered
and factored differently (per group, scale times the sum of x times the codes, minus
(8 * scale + zero_scale) times x's sum), so results agree within float32 rounding of
|x| . |W|, not bit for bit.

The extension holds an AVX-512 and an AVX2 build of its loop beside a portable one
and runs the best this CPU has (`PATHS`, best first); `int4_matmul(..., path=)` picks
one by name (the tests run each).

Above `MAX_ROWS` rows (prefill) the reference's one dequantization is shared by
enough rows that its float32 GEMM catches up (2 cores, AVX-512, the fused kernel's
speed-up over the reference at 8 / 12 / 16 rows: 576x576 1.35 / 1.18 / 0.96x,
1536x576 1.83 / 1.28 / 1.43x, 1024x2048 3.9 / 1.9 / 2.3x).

With `int8_activations` (an engine option, off by default) the same weights
multiply x quantized to int8 as llama.cpp's Q8_1 does (`quantize_activations`: per
block of `Q8_BLOCK` columns, d = absmax / 127, q = round(x / d)) by integer
int4 x int8 dot products (AVX-512 VNNI `vpdpbusd`, AVX-VNNI, AVX2 `vpmaddubsw`, or
portable C; `Q8_PATHS`): the result is x's int8 rounding times W, exact integer
sums per 8 columns scaled in float32, so it equals `dequantize_activations(x) @
W^T` within float32 rounding and differs from the float path by x's quantization
error (at most d / 2 per column).

Optional: where the extension is not built (a checkout run without installing it,
as a GPU image runs `kernels.bench`) or bytes are big-endian, `AVAILABLE` is False
and the reference runs.
"""

from __future__ import annotations

import sys

import torch

from kernels.cpu_matmul import as_array, takes
from kernels.cpu_matmul import threads as cpu_threads

try:
    from kernels import _int4_cpu
except ImportError:  # not built: the torch reference runs (module docstring)
    _int4_cpu = None

AVAILABLE = _int4_cpu is not None and sys.byteorder == "little"
PATHS: tuple[str, ...] = _int4_cpu.paths() if AVAILABLE else ()
Q8_PATHS: tuple[str, ...] = _int4_cpu.q8_paths() if AVAILABLE else ()
MAX_ROWS = 8
Q8_BLOCK = 32  # columns of x sharing one int8 scale (llama.cpp's Q8_1 block)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K a multiple of Q8_BLOCK) -> (q [M, K] int8, d [M, K /
    Q8_BLOCK] float32) as `int4_matmul(..., int8_activations=True)` rounds it:
    d = absmax / 127 per block, q = round(x / d) (ties to even), an all-zero block
    d = 0 and q = 0. The torch reference of the extension's quantization."""
    m, k = x.shape
    blocks = x.reshape(m, k // Q8_BLOCK, Q8_BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks))
    return q.to(torch.int8).reshape(m, k), d.squeeze(-1)


def dequantize_activations(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 activations `quantize_activations` rounds x to: q times its
    block's d."""
    m, k = q.shape
    blocks = q.float().reshape(m, k // Q8_BLOCK, Q8_BLOCK) * d.unsqueeze(-1)
    return blocks.reshape(m, k)


def applies(x: torch.Tensor, group_size: int) -> bool:
    """Whether `int4_matmul` takes these activations: float32 on a CPU, at most
    MAX_ROWS rows, a group of 16 to 1024 columns (a multiple of 16)."""
    return takes(x, group_size, available=AVAILABLE, max_rows=MAX_ROWS, unit=16)


def int4_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    weight_zero_scale: torch.Tensor | None = None,
    path: str | None = None,
    int8_activations: bool = False,
) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32, W pack-quantized int4 [N, K / 8]
    int32 with scales (and zp * scale) [N, K / g]; shapes checked by the caller
    (`weight_int4_matmul`), buffer sizes again by the extension. `path` names one of
    `PATHS` (None: the best one for this group size), or of `Q8_PATHS` with
    `int8_activations` (x rounded to int8 per block: module docstring; the group a
    multiple of Q8_BLOCK)."""
    m, k = x.shape
    n = weight_packed.shape[0]
    threads = cpu_threads(m, n, k)
    y = torch.empty(m, n, dtype=torch.float32)
    zero_scale = None
    if weight_zero_scale is not None:
        zero_scale = as_array(weight_zero_scale.float())
    kernel = _int4_cpu.int4_matmul_q8 if int8_activations else _int4_cpu.int4_matmul
    kernel(
        as_array(x),
        as_array(weight_packed),
        as_array(weight_scale.float()),
        zero_scale,
        y.numpy(),
        m,
        n,
        k,
        group_size,
        threads,
        path,
    )
    return y


class PreparedInt4:
    """One int4 weight's arrays as `int4_matmul` passes them to the extension,
    made once (at load) instead of on every call: at decode the per-call
    conversions and checks cost SmolLM2's w4a16 step more than the kernel itself.
    Holds the tensors it views; `int4_matmul_prepared` multiplies by it, with x
    rounded to int8 per block where `int8_activations` is set (module docstring;
    `takes_int8_activations` says whether this weight's group allows it)."""

    def __init__(
        self,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        group_size: int,
        weight_zero_scale: torch.Tensor | None = None,
    ) -> None:
        self.n = weight_packed.shape[0]
        self.k = weight_packed.shape[1] * 8
        self.group_size = group_size
        self._tensors = [
            t.detach().float().contiguous() if t.is_floating_point() else t
            for t in (weight_scale, weight_zero_scale)
            if t is not None
        ]
        self.packed = as_array(weight_packed)
        self.scale = self._tensors[0].numpy()
        self.zero_scale = self._tensors[1].numpy() if len(self._tensors) > 1 else None
        self._tensors.append(weight_packed)
        self.int8_activations = False

    @property
    def takes_int8_activations(self) -> bool:
        """Whether the int8-activation kernel takes this weight: a group that is a
        multiple of Q8_BLOCK."""
        return self.group_size % Q8_BLOCK == 0


def int4_matmul_prepared(x: torch.Tensor, weight: PreparedInt4) -> torch.Tensor:
    """`int4_matmul` (same kernel, same threads, the same result) over a
    `PreparedInt4`; x [M, K] float32 with `applies`, checked by the caller; x
    rounded to int8 where the weight's `int8_activations` is set."""
    m = x.shape[0]
    n, k = weight.n, weight.k
    threads = cpu_threads(m, n, k)
    y = torch.empty(m, n, dtype=torch.float32)
    q8 = weight.int8_activations
    kernel = _int4_cpu.int4_matmul_q8 if q8 else _int4_cpu.int4_matmul
    kernel(
        as_array(x),
        weight.packed,
        weight.scale,
        weight.zero_scale,
        y.numpy(),
        m,
        n,
        k,
        weight.group_size,
        threads,
        None,
    )
    return y
