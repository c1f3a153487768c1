"""The group-wise int8 weight-only matmul for a few rows of float32 activations on a
CPU (`_int8_cpu.c`, compiled by `pip install`): what an int8 output head
(`gpuagent.engine.weights.Int8Head`) runs at decode. W [N, K] is held as int8 codes
[N, K] and float32 scales [N, K / group] (llama.cpp's Q8_0 at group 32); activations
stay float32 (not rounded to int8 as llama.cpp's q8 dot rounds them), products and
sums are float32, so results agree with the float reference x @ (c * s)^T within
float32 rounding of |x| . |W|, not bit for bit.

The extension holds an AVX-512 and an AVX2 build of its loop beside a portable one
and runs the best this CPU has (`PATHS`, best first); `int8_matmul(..., path=)`
picks one by name (the tests run each).

Above `MAX_ROWS` rows (prefill) `int8_matmul_blocked` runs instead: W dequantized
`BLOCK_ROWS` rows at a time into a float32 GEMM, never as a whole float matrix.

Optional: where the extension is not built or bytes are big-endian, `AVAILABLE` is
False and the callers run the blocked float path at every row count.
"""

from __future__ import annotations

import sys

import torch

from kernels.cpu_matmul import as_array, takes
from kernels.cpu_matmul import threads as cpu_threads

try:
    from kernels import _int8_cpu
except ImportError:  # not built: the blocked float path runs (module docstring)
    _int8_cpu = None

AVAILABLE = _int8_cpu is not None and sys.byteorder == "little"
PATHS: tuple[str, ...] = _int8_cpu.paths() if AVAILABLE else ()
MAX_ROWS = 16
BLOCK_ROWS = 4096  # rows of W dequantized at a time by `int8_matmul_blocked`


def applies(x: torch.Tensor, group_size: int) -> bool:
    """Whether `int8_matmul` takes these activations: float32 on a CPU, 1 to
    MAX_ROWS rows, a group of 8 to 1024 columns (a multiple of 8)."""
    return takes(x, group_size, available=AVAILABLE, max_rows=MAX_ROWS, unit=8)


def quantize_int8(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """Symmetric round-to-nearest int8 of `weight` [N, K] in groups of `group_size`
    columns as llama.cpp's Q8_0 (scale = max |w| / 127, codes in -127..127;
    ties to even, where Q8_0 rounds them away from zero):
    (codes [N, K] int8, scales [N, K / group] float32). A matrix already of that
    form (a head converted from a Q8_0 GGUF) comes back exactly."""
    n, k = weight.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"int8 group size {group_size} does not divide {k} columns")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    scale = w.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k).contiguous(), scale.contiguous()


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix c * s [N, K] that `quantize_int8`'s output stands for."""
    n, k = codes.shape
    groups = scale.shape[1]
    w = codes.float().reshape(n, groups, k // groups) * scale.float()[..., None]
    return w.reshape(n, k)


def int8_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    path: str | None = None,
) -> torch.Tensor:
    """x [M, K] float32 (`applies`) @ W^T -> [M, N] float32, W = codes [N, K] int8
    times scale [N, K / g] float32 per group; buffer sizes checked by the
    extension. `path` names one of `PATHS` (None: the best one for this group)."""
    m, k = x.shape
    n = codes.shape[0]
    group = k // scale.shape[1]
    threads = cpu_threads(m, n, k)
    y = torch.empty(m, n, dtype=torch.float32)
    _int8_cpu.int8_matmul(
        as_array(x),
        as_array(codes),
        as_array(scale.float()),
        y.numpy(),
        m,
        n,
        k,
        group,
        threads,
        path,
    )
    return y


def int8_matmul_blocked(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """x [M, K] @ W^T in x's dtype with W dequantized `BLOCK_ROWS` rows at a time
    (any rows, device or dtype: prefill, and the reference where the extension
    isn't built)."""
    n = codes.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, BLOCK_ROWS):
        rows = slice(start, start + BLOCK_ROWS)
        w = dequantize_int8(codes[rows], scale[rows]).to(x.dtype)
        y[..., rows] = x @ w.t()
    return y
