"""Weight-only quantized linear layers: y = x @ W^T with W dequantized in the kernel.

* int8: q [N, K] int8 and one scale per output channel, W = q * scale[:, None].
  Since the scale is constant along K it is applied once to the accumulator.
* int4: the compressed-tensors "pack-quantized" layout (what vLLM loads):
  weight_packed [N, K / 8] int32, packed along the input dim, eight values per word,
  least-significant nibble first, each stored as q + 8 (q in [-8, 7]);
  weight_scale [N, K / group_size] (model dtype), W = q * scale[n, k // group_size].
  The kernel's K tile divides group_size, so each tile has one scale per column and
  is scaled after its dot. With a zero point (asymmetric), `weight_zero_scale`
  [N, K / group_size] holds zp * scale and W = q * scale - zero_scale per group.

The int4 quantizer follows compressed-tensors' symmetric min-max observer (scale =
absmax / 7.5, q = round(w / scale) clamped to [-8, 7]), so a checkpoint made here
packs bit for bit like one made by llm-compressor. int8 uses absmax / 127 and codes
in [-127, 127] (no clipping of the row maximum).

Small batches (decode, M <= 16) are memory-bound: the launcher splits K across
programs (partial sums in float32, added up by a small second kernel) so that a layer
with few output tiles still fills the GPU; without a split the kernel writes the
output directly. Which tile, pipeline depth and split is fastest differs by GPU and
layer shape: at batches up to 16 a launch takes the config `kernels.matmul_tuning`
measured fastest for its shape on this GPU (the engine tunes at load), else the
heuristic of `_tile_config`.

On a CPU the public ops run torch's own weight-only kernels
(`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu`) when given a
`CpuPackedWeight`: the weight laid out once, at load (`prepack_int8_cpu`,
`prepack_int4_cpu`), activations rounded to bf16 for the multiply (the "a16" of
w8a16 / w4a16) and the output cast back to x's dtype. (The engine lays one out for
a model in bf16 only: a float32 model runs the reference, in its own arithmetic.)
Where those kernels don't
apply (no such op in this torch, int4 group sizes other than 32 / 64 / 128 / 256,
N not a multiple of 16 for int4, K not a multiple of 16 for int8) the prepack
returns None and the torch reference runs. Without a `CpuPackedWeight`, int4 at a
few float32 rows (a float32 model's decode) runs `kernels.int4_cpu`, a compiled
kernel in the reference's own arithmetic that reads each packed weight byte once
instead of dequantizing the whole weight per call.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from kernels import int4_cpu
from kernels._triton import check, tl, triton, use_triton

# Programs to aim for when splitting K (about 2x the SMs of an H100/H200).
_TARGET_PROGRAMS = 264

# --------------------------------------------------------------------------------------
# Torch reference
# --------------------------------------------------------------------------------------


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: w [N, K] -> (q [N, K] int8, scale [N])."""
    check(w.dim() == 2, "weight must be [N, K]")
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / 127.0).clamp_min(1e-10).to(w.dtype)
    q = torch.round(w32 / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes [R, C] (values fitting `bits`) into int32 words
    [R, C * bits / 32] along dim 1: each stored as code + 2^(bits-1), least
    significant bits first (compressed-tensors' pack_to_int32): int4 weights and
    zero points, int8 weights. C * bits must be a multiple of 32."""
    check(bits in (4, 8), f"packing {bits}-bit codes is not supported (4 or 8)")
    per_word = 32 // bits
    rows, cols = codes.shape
    check(
        cols % per_word == 0,
        f"{cols} columns don't fill whole int32 words of {bits} bits",
    )
    unsigned = (codes.to(torch.int64) + (1 << (bits - 1))).view(rows, -1, per_word)
    shifts = bits * torch.arange(per_word, device=codes.device, dtype=torch.int64)
    words = (unsigned << shifts).sum(dim=-1)  # [R, C / per_word] in [0, 2^32)
    # Reinterpret as signed int32 (two's complement), the checkpoint dtype.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 codes q [N, K] (values in [-8, 7]) into [N, K / 8] int32 words."""
    return pack_int32(q, 4)


def _stored_nibbles(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K / 8] int32 words -> [N, K] of `dtype`: each code's stored nibble c in
    [0, 15] (the code is c - 8), converted to `dtype` as it is unpacked."""
    n, k = packed.shape[0], packed.shape[1] * 8
    if sys.byteorder == "little" and packed.is_contiguous():
        # LSB-first nibbles of a little-endian word are its bytes' (low, high)
        # nibbles in memory order: split bytes instead of shifting words, each
        # straight into the even or odd columns.
        as_bytes = packed.view(torch.uint8)  # [N, K/2]
        out = torch.empty(n, k // 2, 2, dtype=dtype, device=packed.device)
        out[..., 0].copy_(as_bytes & 0xF)
        out[..., 1].copy_(as_bytes >> 4)
        return out.view(n, k)
    shifts = 4 * torch.arange(8, device=packed.device, dtype=torch.int32)
    nibbles = (packed[..., None] >> shifts) & 0xF  # [N, K/8, 8]
    return nibbles.flatten(-2).to(dtype)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 [R, W] -> int8 codes [R, cols] (cols at most
    W * 32 / bits: a packed zero-point row may end in padding)."""
    check(bits in (4, 8), f"unpacking {bits}-bit codes is not supported (4 or 8)")
    per_word = 32 // bits
    check(
        cols <= packed.shape[1] * per_word,
        f"{cols} columns don't fit {packed.shape[1]} int32 words of {bits} bits",
    )
    if bits == 4:
        return _stored_nibbles(packed, torch.int8)[:, :cols].sub_(8).contiguous()
    shifts = bits * torch.arange(per_word, device=packed.device, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [R, W] unsigned
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)  # [R, W, per_word]
    return (values.flatten(-2)[:, :cols] - (1 << (bits - 1))).to(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: [N, K / 8] int32 -> [N, K] int8 codes in [-8, 7]."""
    return unpack_int32(packed, 4, packed.shape[1] * 8)


def quantize_weight_int4(
    w: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise symmetric int4: w [N, K] -> (packed [N, K/8] int32, scale [N, K/g]).

    Codes in [-8, 7] with scale = absmax / 7.5 per group of `group_size` inputs.
    """
    check(w.dim() == 2, "weight must be [N, K]")
    n, k = w.shape
    check(k % group_size == 0, f"K={k} must be a multiple of group_size={group_size}")
    groups = w.float().view(n, k // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / 7.5).clamp_min(1e-10).to(w.dtype)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7)
    return pack_int4(q.view(n, k).to(torch.int8)), scale


def dequantize_weight_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int = 128,
    weight_zero_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 W [N, K] from the pack-quantized layout (minus zp * scale per group
    when `weight_zero_scale` [N, K/g] is given)."""
    # The nibbles unpacked straight into float32, W then shifted and scaled in
    # place: per call this is what a float32 model's decode step pays for an int4
    # layer (0.76 ms for 576 x 1536 through int8 codes, 0.49 ms so).
    w = _stored_nibbles(weight_packed, torch.float32)
    n, k = w.shape
    w = w.view(n, k // group_size, group_size).sub_(8)
    # [N, K/g, g] * [N, K/g, 1]: broadcast the group scale instead of repeating it.
    w.mul_(weight_scale.float()[..., None])
    if weight_zero_scale is not None:
        w.sub_(weight_zero_scale.float()[..., None])
    return w.view(n, k)


def weight_int8_matmul_reference(
    x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Torch reference of `weight_int8_matmul` (float32 accumulation)."""
    out = (x.float() @ weight_q.float().t()) * scale.float()
    return out.to(x.dtype)


def weight_int4_matmul_reference(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int = 128,
    weight_zero_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `weight_int4_matmul` (float32 accumulation)."""
    w = dequantize_weight_int4(
        weight_packed, weight_scale, group_size, weight_zero_scale
    )
    return (x.float() @ w.t()).to(x.dtype)


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _dot_operands(x, codes, DOT_FP32: tl.constexpr):
    # Integer codes are exact in bf16/fp16, so on the GPU the dot runs in the input
    # dtype. The interpreter multiplies bf16 as raw uint16 bits and casts int -> bf16
    # wrongly, so there (DOT_FP32) both operands go to float32; int -> float32 first
    # in either case.
    w = codes.to(tl.float32)
    if DOT_FP32:
        return x.to(tl.float32), w
    return x, w.to(x.dtype)


@triton.jit
def _int8_matmul_kernel(
    x_ptr,  # [M, K] activations (bf16/fp16/fp32)
    w_ptr,  # [N, K] int8 weight codes
    scale_ptr,  # [N] per-output-channel scales
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums, or [M, N] output if no split
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0,
        )  # [BLOCK_K, BLOCK_N]
        a, b = _dot_operands(x, w, DOT_FP32)
        acc += tl.dot(a, b)
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    out_ptrs = part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    out = acc.to(part_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_tile(
    w_ptr, scale_ptr, offs_n, n_mask, stride_wn, stride_sn, k0,
    GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # The codes q [BLOCK_N, BLOCK_K // 8, 8] of K columns k0.. of rows offs_n and
    # their group's scale [BLOCK_N] (float32). Element k of a row is nibble k % 8 of
    # word k // 8: whole words are loaded ([BLOCK_N, BLOCK_K // 8], contiguous
    # along K) and their 8 nibbles shifted out.
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(
        w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
        mask=n_mask[:, None],
        other=0,
    )
    shifts = tl.arange(0, 8) * 4
    q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) - 8
    scale = tl.load(
        scale_ptr + offs_n * stride_sn + k0 // GROUP_SIZE, mask=n_mask, other=0.0
    ).to(tl.float32)
    return q, scale


@triton.jit
def _int4_matmul_kernel(
    x_ptr,  # [M, K] activations (bf16/fp16/fp32)
    w_ptr,  # [N, K // 8] int32 packed codes, LSB first, stored as q + 8
    scale_ptr,  # [N, K // GROUP_SIZE] group scales
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums, or [M, N] output if no split
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    k_per_split,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # k_per_split and K are multiples of BLOCK_K, and BLOCK_K divides GROUP_SIZE:
    # no K mask, one scale per column per tile.
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None],
            other=0.0,
        )
        q, scale = _int4_tile(
            w_ptr, scale_ptr, offs_n, n_mask, stride_wn, stride_sn, k0,
            GROUP_SIZE, BLOCK_K,
        )  # fmt: skip
        # merge (word, nibble) into k = 8 * word + nibble: [BLOCK_N, BLOCK_K]
        q = tl.reshape(q, [BLOCK_N, BLOCK_K])
        a, b = _dot_operands(x, tl.trans(q), DOT_FP32)
        acc += tl.dot(a, b) * scale[None, :]
    out_ptrs = part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    out = acc.to(part_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_gemv_kernel(
    x_ptr,  # [M, K] activations (bf16/fp16/fp32)
    w_ptr,  # [N, K // 8] int32 packed codes, LSB first, stored as q + 8
    scale_ptr,  # [N, K // GROUP_SIZE] group scales
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums, or [M, N] output if no split
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    k_per_split,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # unused: the products are float32 FMAs here
):
    # The int4 kernel without tl.dot, for a few rows of x (decode): the words
    # [BLOCK_N, BLOCK_K // 8] are split into nibbles [BLOCK_N, BLOCK_K // 8, 8] that
    # line up with x viewed as [BLOCK_K // 8, 8] (k = 8 * word + nibble), multiplied
    # and summed in float32 with no reshape of the weight tile and no padding of M
    # to tl.dot's 16 rows.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        q, scale = _int4_tile(
            w_ptr, scale_ptr, offs_n, n_mask, stride_wn, stride_sn, k0,
            GROUP_SIZE, BLOCK_K,
        )  # fmt: skip
        w = q.to(tl.float32)  # [BLOCK_N, BLOCK_K // 8, 8]
        offs_k = k0 + tl.arange(0, BLOCK_K).reshape(BLOCK_K // 8, 8)
        for i in tl.static_range(BLOCK_M):
            # rows past M read row M - 1 (K is a multiple of BLOCK_K: no mask);
            # the store leaves them out
            m = tl.minimum(pid_m * BLOCK_M + i, M - 1)
            x = tl.load(x_ptr + m * stride_xm + offs_k).to(tl.float32)
            dot = tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)  # [BLOCK_N]
            acc += tl.where(rows[:, None] == i, (dot * scale)[None, :], 0.0)
    offs_m = pid_m * BLOCK_M + rows
    out_ptrs = part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    out = acc.to(part_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=(offs_m[:, None] < M) & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # [SPLIT_K, numel] float32 partial sums
    out_ptr,  # [numel] output (activation dtype)
    numel,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(part_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class TileConfig:
    """One launch of the weight-only kernels: tile sizes, warps, software-pipeline
    stages, and the K split (None: `_split_k` picks it from the grid)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3  # Triton's own default on CUDA
    split_k: int | None = None
    gemv: bool = False  # int4: `_int4_gemv_kernel` (no tl.dot), block_m rows each


# The fastest config measured on this GPU (`kernels.matmul_tuning`) per (bits, M
# bucket, N, K, group size), for batches up to TUNED_MAX_M (decode, where the op is
# memory-bound and the tile shape decides how much of the bandwidth it gets);
# anything not in it launches `_tile_config`'s heuristic.
TUNED_MAX_M = 16
TUNED_CONFIGS: dict[tuple[int, int, int, int, int | None], TileConfig] = {}


def m_bucket(m: int) -> int:
    """The batch sizes a tuned config covers: the next power of two >= m."""
    return 1 << max(m - 1, 0).bit_length()


def launch_config(
    bits: int, m: int, n: int, k: int, group_size: int | None
) -> TileConfig:
    """The config a launch of `bits` ([M, K] @ [N, K]^T) uses: the tuned one for its
    shape and M bucket, else the heuristic."""
    if m <= TUNED_MAX_M:
        tuned = TUNED_CONFIGS.get((bits, m_bucket(m), n, k, group_size))
        if tuned is not None:
            return tuned
    return heuristic_config(bits, m, group_size)


def heuristic_config(bits: int, m: int, group_size: int | None) -> TileConfig:
    """`_tile_config(m)` with its K tile cut to what the int`bits` kernel takes."""
    config = _tile_config(m)
    return replace(
        config, block_k=min(config.block_k, _block_k_limit(bits, group_size))
    )


def _block_k_limit(bits: int, group_size: int | None) -> int:
    # the int8 kernel masks K in tiles of at most 128; the int4 kernel's K tile must
    # divide the group (one scale per column per tile)
    return 128 if bits == 8 else group_size


def block_k_fits(block_k: int, bits: int, group_size: int | None) -> bool:
    """Whether the int`bits` kernel takes a K tile of `block_k`."""
    limit = _block_k_limit(bits, group_size)
    return block_k <= limit and limit % block_k == 0


def _tile_config(m: int) -> TileConfig:
    """The heuristic config for a batch of m rows."""
    if m <= 16:
        return TileConfig(16, 64, 128, 4)
    if m <= 64:
        return TileConfig(64, 64, 64, 4)
    return TileConfig(128, 128, 64, 8)


def _split_k(grid_mn: int, k_tiles: int) -> int:
    """Split K so the launch has about _TARGET_PROGRAMS programs, >= 4 tiles each."""
    want = max(1, _TARGET_PROGRAMS // grid_mn)
    return max(1, min(want, k_tiles // 4 if k_tiles >= 8 else k_tiles))


def _check_x(x: torch.Tensor, k: int) -> None:
    check(x.dim() == 2 and x.shape[1] == k, f"x must be [M, {k}], got {tuple(x.shape)}")
    check(
        x.dtype in (torch.bfloat16, torch.float16, torch.float32),
        f"x must be bf16/fp16/fp32, got {x.dtype}",
    )


def _launch(kernel, x, w, scale, n, k, extra_strides, extra_consts, config):
    m = x.shape[0]
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = config.split_k or _split_k(grid_m * grid_n, k_tiles)
    k_per_split = triton.cdiv(k_tiles, split) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    # Without a split the kernel writes the output itself: at decode batch sizes
    # every extra launch is a visible share of the time.
    part = out
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    kernel[(grid_m, grid_n, split)](
        x,
        w,
        scale,
        part,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        *extra_strides,
        k_per_split,
        **extra_consts,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_FP32=not x.is_cuda,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, out, m * n, SPLIT_K=split, BLOCK=block
        )
    return out


def _checked_config(
    config: TileConfig, bits: int, group_size: int | None
) -> TileConfig:
    check(
        block_k_fits(config.block_k, bits, group_size),
        f"block_k={config.block_k} must divide {_block_k_limit(bits, group_size)}",
    )
    if not config.gemv:
        check(config.block_m >= 16, "block_m must be >= 16 (tl.dot's smallest tile)")
    return config


def _weight_int8_matmul_triton(x, weight_q, scale, config=None):
    check(x.stride(1) == 1, "x must be contiguous in K")
    check(weight_q.is_contiguous(), "weight_q must be contiguous [N, K]")
    check(scale.is_contiguous(), "scale must be contiguous [N]")
    n, k = weight_q.shape
    config = _checked_config(
        config or launch_config(8, x.shape[0], n, k, None), 8, None
    )
    check(not config.gemv, "the gemv kernel is int4 only")
    return _launch(_int8_matmul_kernel, x, weight_q, scale, n, k, (), {}, config)


def _weight_int4_matmul_triton(x, weight_packed, weight_scale, group_size, config=None):
    check(x.stride(1) == 1, "x must be contiguous in K")
    check(weight_packed.is_contiguous(), "weight_packed must be contiguous")
    check(weight_scale.stride(1) == 1, "weight_scale must be contiguous by group")
    check(
        group_size >= 16 and group_size & (group_size - 1) == 0,
        "Triton int4 matmul needs a power-of-two group_size >= 16",
    )
    n = weight_packed.shape[0]
    k = x.shape[1]
    config = _checked_config(
        config or launch_config(4, x.shape[0], n, k, group_size), 4, group_size
    )
    return _launch(
        _int4_gemv_kernel if config.gemv else _int4_matmul_kernel,
        x,
        weight_packed,
        weight_scale,
        n,
        k,
        (weight_scale.stride(0),),
        {"GROUP_SIZE": group_size},
        config,
    )


# --------------------------------------------------------------------------------------
# CPU: torch's weight-only kernels over a weight laid out once
# --------------------------------------------------------------------------------------

# Group sizes torch's int4 CPU kernel accepts (it raises on any other).
CPU_INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class CpuPackedWeight:
    """A quantized weight laid out for torch's CPU weight-only kernels.

    The int4 layout depends on the CPU the process runs on (AVX-512, AVX2, other),
    so it is made in the process that uses it (`prepack_int8_cpu`,
    `prepack_int4_cpu`) and never saved.
    """

    bits: int  # 8 or 4
    out_features: int  # N
    in_features: int  # K
    weight: torch.Tensor  # int8 codes [N, K], or torch's int4 pack [N, K / 2] uint8
    scales: torch.Tensor  # bf16 [N], or bf16 scales and zeros [K / g, N, 2]
    group_size: int | None = None
    has_zero_point: bool = False


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # The AVX-512 int8 kernel uses aligned 32-byte loads of x and 16-byte loads of
    # the codes; torch's CPU allocator aligns to 64, a view may start anywhere.
    t = t.contiguous()
    return t.clone() if t.data_ptr() % 64 else t


def prepack_int8_cpu(
    weight_q: torch.Tensor, scale: torch.Tensor
) -> CpuPackedWeight | None:
    """`weight_q` [N, K] int8 and `scale` [N] for `torch._weight_int8pack_mm`, or
    None where it doesn't apply: not CPU tensors, no such op in this torch, or K not
    a multiple of 16 (the AVX-512 kernel steps through K 16 at a time with aligned
    loads: K=200 gave wrong sums on torch 2.13, K=7, 33 or 63 crashed the process).
    The codes are used as they are (no copy unless misaligned); scales go to bf16."""
    n, k = weight_q.shape
    if weight_q.device.type != "cpu" or not hasattr(torch, "_weight_int8pack_mm"):
        return None
    if k % 16:
        return None
    scales = scale.to(torch.bfloat16).contiguous()
    return CpuPackedWeight(8, n, k, _aligned(weight_q), scales)


def prepack_int4_cpu(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    weight_zero_scale: torch.Tensor | None = None,
) -> CpuPackedWeight | None:
    """The pack-quantized int4 weight repacked for `torch._weight_int4pack_mm_for_cpu`
    (once: about 0.2 s for 14336 x 4096 on one core), or None where that kernel
    doesn't apply: not CPU tensors, no such ops in this torch, `group_size` not in
    CPU_INT4_GROUP_SIZES, or N not a multiple of 16 (the packer's own checks).

    The kernel computes W = (c - 8) * scale + zero with c the stored nibble in
    [0, 15], that is our code q = c - 8, so zero = -(zp * scale) (0 when
    symmetric); scales and zeros are held in bf16."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    if weight_packed.device.type != "cpu" or not (
        hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
        and hasattr(torch, "_weight_int4pack_mm_for_cpu")
    ):
        return None
    if group_size not in CPU_INT4_GROUP_SIZES or n % 16 or k % group_size:
        return None
    stored = _stored_nibbles(weight_packed, torch.int32)  # [N, K] in [0, 15]
    # The second argument (inner K tiles) is a CUDA layout parameter the CPU packer
    # ignores (same bytes for 1, 2, 4, 8).
    weight = torch._convert_weight_to_int4pack_for_cpu(stored, 2)  # [N, K/2] uint8
    scale = weight_scale.float().t()  # [K/g, N]
    zero = torch.zeros_like(scale)
    if weight_zero_scale is not None:
        zero = -weight_zero_scale.float().t()
    scales = torch.stack((scale, zero), dim=-1).to(torch.bfloat16)  # [K/g, N, 2]
    return CpuPackedWeight(
        4,
        n,
        k,
        weight,
        scales.contiguous(),
        group_size,
        weight_zero_scale is not None,
    )


def _weight_matmul_cpu(x: torch.Tensor, packed: CpuPackedWeight) -> torch.Tensor:
    x16 = _aligned(x.to(torch.bfloat16))  # [M, K]; the kernels are bf16-only fast
    if packed.bits == 8:
        y = torch._weight_int8pack_mm(x16, packed.weight, packed.scales)
    else:
        y = torch._weight_int4pack_mm_for_cpu(
            x16, packed.weight, packed.group_size, packed.scales
        )
    return y.to(x.dtype)  # [M, N]


def _check_cpu_weight(
    packed: CpuPackedWeight,
    bits: int,
    n: int,
    k: int,
    group_size: int | None = None,
    has_zero_point: bool = False,
) -> None:
    got = (packed.bits, packed.out_features, packed.in_features)
    check(
        got == (bits, n, k),
        f"cpu_weight is int{packed.bits} [{packed.out_features}, "
        f"{packed.in_features}], the op int{bits} [{n}, {k}]",
    )
    check(
        (packed.group_size, packed.has_zero_point) == (group_size, has_zero_point),
        "cpu_weight's group size or zero point differs from the op's arguments",
    )


# --------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------


def weight_int8_matmul(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    scale: torch.Tensor,
    impl: str = "auto",
    cpu_weight: CpuPackedWeight | None = None,
) -> torch.Tensor:
    """x [M, K] @ (weight_q [N, K] int8 * scale [N, 1])^T -> [M, N] in x's dtype.

    On a CPU, impl="auto" with `cpu_weight` (`prepack_int8_cpu` of these tensors)
    runs torch's int8 kernel, x rounded to bf16; without it, the torch reference."""
    check(weight_q.dim() == 2 and weight_q.dtype == torch.int8, "weight_q: [N,K] int8")
    n, k = weight_q.shape
    _check_x(x, k)
    check(scale.shape == (n,), f"scale must be [{n}], got {tuple(scale.shape)}")
    if use_triton(impl, x, weight_q, scale):
        return _weight_int8_matmul_triton(x, weight_q, scale)
    if impl == "auto" and cpu_weight is not None and x.device.type == "cpu":
        _check_cpu_weight(cpu_weight, 8, n, k)
        return _weight_matmul_cpu(x, cpu_weight)
    return weight_int8_matmul_reference(x, weight_q, scale)


def weight_int4_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int = 128,
    impl: str = "auto",
    weight_zero_scale: torch.Tensor | None = None,
    cpu_weight: CpuPackedWeight | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T for pack-quantized int4 W (module docstring) -> [M, N].

    `weight_zero_scale` [N, K/g] (zp * scale) makes W asymmetric. On a CPU,
    impl="auto" with `cpu_weight` (`prepack_int4_cpu` of these tensors) runs torch's
    int4 kernel, x rounded to bf16; without it, a few float32 rows (decode) run the
    fused kernel of `kernels.int4_cpu`, anything else the torch reference."""
    check(
        weight_packed.dim() == 2 and weight_packed.dtype == torch.int32,
        "weight_packed must be [N, K/8] int32",
    )
    n = weight_packed.shape[0]
    k = weight_packed.shape[1] * 8
    _check_x(x, k)
    check(k % group_size == 0, f"K={k} must be a multiple of group_size={group_size}")
    groups = k // group_size
    check(
        weight_scale.shape == (n, groups),
        f"weight_scale must be [{n}, {groups}], got {tuple(weight_scale.shape)}",
    )
    zero_scale = weight_zero_scale
    check(
        zero_scale is None or zero_scale.shape == (n, groups),
        f"weight_zero_scale must be [{n}, {groups}]",
    )
    if use_triton(impl, x, weight_packed, weight_scale):
        y = _weight_int4_matmul_triton(x, weight_packed, weight_scale, group_size)
        if zero_scale is None:
            return y
        # x (q s - zs)^T = x (q s)^T - (x summed per group) zs^T: [M, K/g] @ [K/g, N]
        sums = x.unflatten(-1, (groups, group_size)).float().sum(-1)
        return y - (sums @ zero_scale.float().t()).to(y.dtype)
    if impl == "auto" and cpu_weight is not None and x.device.type == "cpu":
        _check_cpu_weight(cpu_weight, 4, n, k, group_size, zero_scale is not None)
        return _weight_matmul_cpu(x, cpu_weight)
    if impl == "auto" and int4_cpu.applies(x, group_size):
        return int4_cpu.int4_matmul(
            x, weight_packed, weight_scale, group_size, zero_scale
        )
    return weight_int4_matmul_reference(
        x, weight_packed, weight_scale, group_size, zero_scale
    )
