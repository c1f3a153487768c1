"""What the CPU weight-only matmul extensions (`kernels.int4_cpu`,
`kernels.int8_cpu`; their C side shares `_cpu_paths.h`) share on the Python side:
which activations they take, how many threads a call splits W's rows across, and
how tensors are handed to them."""

from __future__ import annotations

import torch

# Rows of W are split across threads only when each thread gets this many
# multiply-adds (rows of x times weights): a thread start costs about 70 us on the
# 2-core dev machine, what 2^21 of them take there (int4, two threads' speed-up
# over one, AVX-512: N x K = 1024x2048 at one row 0.73x, at four rows 1.23x;
# 2048x2048 at one row 1.01x; 4096x4096 at one row 1.55x).
MIN_PRODUCTS_PER_THREAD = 1 << 21
MAX_THREADS = 64  # the extensions' limit


def takes(
    x: torch.Tensor, group_size: int, *, available: bool, max_rows: int, unit: int
) -> bool:
    """Whether an extension (`available`) takes these activations: float32 on a
    CPU, 1 to `max_rows` rows, a group of `unit` to 1024 columns (a multiple of
    `unit`, the width its loop steps by)."""
    return (
        available
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and 1 <= x.shape[0] <= max_rows
        and group_size % unit == 0
        and unit <= group_size <= 1024
    )


def threads(m: int, n: int, k: int) -> int:
    """Threads for an [m, k] x [k, n] product: torch's thread count, at most
    MAX_THREADS, and no more than give each MIN_PRODUCTS_PER_THREAD."""
    most = max(1, min(torch.get_num_threads(), MAX_THREADS))
    return min(most, max(1, m * n * k // MIN_PRODUCTS_PER_THREAD))


def as_array(t: torch.Tensor):
    """A contiguous numpy view (or copy) of `t` for an extension's buffer."""
    return t.detach().contiguous().numpy()
