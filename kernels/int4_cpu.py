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
MAX_ROWS = 8


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
) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32, W pack-quantized int4 [N, K / 8]
    int32 with scales (and zp * scale) [N, K / g]; shapes checked by the caller
    (`weight_int4_matmul`), buffer sizes again by the extension. `path` names one of
    `PATHS` (None: the best one for this group size)."""
    m, k = x.shape
    n = weight_packed.shape[0]
    threads = cpu_threads(m, n, k)
    y = torch.empty(m, n, dtype=torch.float32)
    zero_scale = None
    if weight_zero_scale is not None:
        zero_scale = as_array(weight_zero_scale.float())
    _int4_cpu.int4_matmul(
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
    Holds the tensors it views; `int4_matmul_prepared` multiplies by it."""

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


def int4_matmul_prepared(x: torch.Tensor, weight: PreparedInt4) -> torch.Tensor:
    """`int4_matmul` (same kernel, same threads, the same result) over a
    `PreparedInt4`; x [M, K] float32 with `applies`, checked by the caller."""
    m = x.shape[0]
    n, k = weight.n, weight.k
    threads = cpu_threads(m, n, k)
    y = torch.empty(m, n, dtype=torch.float32)
    _int4_cpu.int4_matmul(
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
