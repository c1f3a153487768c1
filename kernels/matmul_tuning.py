"""Pick the weight-only matmuls' launch config by timing them on this GPU.

At decode batch sizes a weight-only matmul is memory-bound: its speed is how much of
the HBM bandwidth the launch keeps busy, which the tile shape, warps, pipeline depth
and K split decide differently per GPU and per layer shape, and at one to four rows
a kernel without tl.dot (`_int4_gemv_kernel`, which pads no rows) may beat one with
it. `tune` times a fixed set of candidates (`candidate_configs`, the heuristic
among them) for one layer shape at each batch bucket, checks each candidate's output
against the heuristic's, and records the fastest in `weight_matmul.TUNED_CONFIGS`,
which the public ops then launch. The engine tunes its quantized layers' shapes at
load on CUDA; `kernels.bench` tunes before it times.

A candidate that fails to build or run here (too much shared memory for this GPU) or
that gives another result is left out, so a tuned config is never slower than the
heuristic as measured and never wrong.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kernels import weight_matmul
from kernels._triton import HAS_TRITON, triton
from kernels.weight_matmul import TileConfig

DECODE_BATCHES = (1, 2, 4, 8, 16)
# Batches the int4 gemv kernel is a candidate at (it unrolls a loop per row).
GEMV_MAX_M = 4
# Timer(fn) -> milliseconds per call.
Timer = Callable[[Callable[[], object]], float]


@dataclass(frozen=True)
class TuneResult:
    """The fastest config at one batch bucket of one layer shape, and the heuristic's
    time beside it."""

    bits: int
    batch: int
    n: int
    k: int
    group_size: int | None
    config: TileConfig
    ms: float
    heuristic_ms: float
    candidates: int  # how many ran and matched


def candidate_configs(
    bits: int, group_size: int | None, batch: int = 1
) -> list[TileConfig]:
    """The heuristic's decode config, then tl.dot tiles of 32..128 outputs by
    64..256 of K (as far as the int`bits` kernel takes them), 3 or 4 pipeline
    stages, K split by the heuristic or not at all; for int4 at batches up to
    GEMV_MAX_M also the gemv kernel (all `batch` rows in one program, 16..64
    outputs), split or not."""
    out = [weight_matmul.heuristic_config(bits, 1, group_size)]
    for block_n, block_k, stages, split in itertools.product(
        (32, 64, 128), (64, 128, 256), (3, 4), (None, 1)
    ):
        out.append(TileConfig(16, block_n, block_k, 4, stages, split))
    if bits == 4 and batch <= GEMV_MAX_M:
        for block_n, block_k, split in itertools.product(
            (16, 32, 64), (64, 128, 256), (None, 1)
        ):
            out.append(TileConfig(batch, block_n, block_k, 4, 3, split, gemv=True))
    fits = (c for c in out if weight_matmul.block_k_fits(c.block_k, bits, group_size))
    return list(dict.fromkeys(fits))  # the heuristic first, once


def default_timer(fn: Callable[[], object]) -> float:
    """`triton.testing.do_bench`, short: enough to rank tiles a few us apart."""
    return float(triton.testing.do_bench(fn, warmup=5, rep=25))


def tune(
    bits: int,
    n: int,
    k: int,
    group_size: int | None = None,
    batches: Iterable[int] = DECODE_BATCHES,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    timer: Timer | None = None,
    candidates: list[TileConfig] | None = None,
) -> list[TuneResult]:
    """Time the candidates for an int`bits` layer [N, K] (int4: `group_size`) at
    each batch (standing for its bucket, `weight_matmul.m_bucket`; at most
    TUNED_MAX_M) on random weights, record the fastest per bucket in
    `weight_matmul.TUNED_CONFIGS`, and return what was picked."""
    if not HAS_TRITON:
        raise RuntimeError("tuning the weight-only matmuls needs triton")
    from triton.errors import TritonError

    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if (bits == 4) != (group_size is not None):
        raise ValueError("int4 needs a group_size; int8 has none")
    buckets = sorted({weight_matmul.m_bucket(b) for b in batches})
    if buckets and buckets[-1] > weight_matmul.TUNED_MAX_M:
        raise ValueError(
            f"batch bucket {buckets[-1]} > TUNED_MAX_M={weight_matmul.TUNED_MAX_M}"
        )
    timer = timer or default_timer
    run = _runner(bits, n, k, group_size, dtype, device)
    results = []
    for batch in buckets:
        heuristic = weight_matmul.heuristic_config(bits, batch, group_size)
        x = torch.randn(batch, k, device=device).to(dtype)
        expected = run(x, heuristic).float()
        # configs differ in summation order only: a bf16 output may differ by an
        # ulp or two; a wrong tile is off by the size of the values
        atol = 1e-2 * float(expected.abs().max()) + 1e-6
        heuristic_ms = timer(lambda x=x, c=heuristic: run(x, c))
        best, best_ms, ran = heuristic, heuristic_ms, 0
        for config in candidates or candidate_configs(bits, group_size, batch):
            try:
                got = run(x, config).float()
            except TritonError:  # e.g. more shared memory than this GPU has
                continue
            if not torch.allclose(got, expected, atol=atol, rtol=0):
                continue  # another result than the heuristic's: never picked
            ran += 1
            ms = (
                heuristic_ms
                if config == heuristic
                else timer(lambda x=x, c=config: run(x, c))
            )
            if ms < best_ms:
                best, best_ms = config, ms
        weight_matmul.TUNED_CONFIGS[(bits, batch, n, k, group_size)] = best
        results.append(
            TuneResult(bits, batch, n, k, group_size, best, best_ms, heuristic_ms, ran)
        )
    return results


def _runner(bits, n, k, group_size, dtype, device):
    """run(x, config): the Triton launch with `config` of a random int`bits` [N, K]
    layer, its scales in `dtype` (x's)."""
    g = torch.Generator().manual_seed(0)
    if bits == 4:
        words = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g)
        packed = words.to(torch.int32).to(device)
        scale = torch.rand(n, k // group_size, generator=g) * 1e-2
        scale = scale.to(device, dtype)
        return lambda x, config: weight_matmul._weight_int4_matmul_triton(
            x, packed, scale, group_size, config
        )
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8).to(device)
    scale8 = (torch.rand(n, generator=g) * 1e-2).to(device, dtype)
    return lambda x, config: weight_matmul._weight_int8_matmul_triton(
        x, q, scale8, config
    )
