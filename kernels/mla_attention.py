"""Paged MLA decode attention (DeepSeek-V2/V3, Kimi K2) over the latent cache.

The cache (`gpuagent.engine.mla.allocate_mla_cache`) holds one row per token of
RANK + ROPE values, the compressed latent c then the rotated RoPE key k_pe, shared
by every query head; the value tensor has width 0. Decode runs in the absorbed form:
the caller folds W_UK into the query (q_lat = W_UK^T q_nope, [B, H, RANK]) and
maps the output back to values with W_UV, so per sequence and head

    scores_j = softmax_scale * (q_lat . c_j + q_pe . k_pe_j)
    out = sum_j softmax(scores)_j c_j      ([B, H, RANK], latent space)

Stored rows, per cache dtype (`scale` below is `cache.key_scale`):

==============  ===========================  ===================================
dtype           key [nb, bs, 1, RANK+ROPE]   scale
==============  ===========================  ===================================
bf16/fp16/fp32  the values, cast             None
fp8-per-token   e4m3 codes                   [nb, bs, 2] float16 (latent, RoPE)
int8            int8 codes                   [1] float32 (latent), static;
                                             `cache.rope_scale` [nb, bs] float16
fp8             e4m3 codes (latent),         [1] float32 (latent), static;
                int8 codes (RoPE)            `cache.rope_scale` [nb, bs] float16
==============  ===========================  ===================================

a stored value being code * its part's scale (int4 is refused for MLA; the RoPE
key of int8 and fp8 is int8 per token: e4m3 on it missed fp8's quality bar, a
second per-token scale int8's bytes bar, `gpuagent.engine.mla`).

The Triton kernel runs one program per (group of HEAD_BLOCK query heads, sequence,
context partition of PARTITION_SIZE tokens): every head of the group shares each
latent tile, gathered token by token through the block table (any block size,
any context length) and loaded once per program. The codes go into the dots as
they are; a token's scales multiply its score (latent and RoPE parts apart) and
its probability before the probability-weighted sum of latents (int8's and
fp8's static latent scale folds into the query and the output instead), which is
the same sum as dequantizing the tile first without a multiply per element.
Online softmax in float32; partitions are merged by `paged_attention`'s reduce
kernel (flash-decoding).
"""

from __future__ import annotations

import torch

from kernels._triton import check, tl, triton, use_triton
from kernels.kv_quant import KV_DTYPE_CODES, PagedKVCache, dequantize_kv
from kernels.paged_attention import _dot_precision, reduce_partitions

# The latent cache's dtypes (int4 is refused: the latent is not rotated, and its
# outliers would take the whole 16 levels).
MLA_KERNEL_DTYPES = ("bf16", "fp16", "fp32", "int8", "fp8-per-token", "fp8")
# Tokens per decode program; as the Llama decode.
PARTITION_SIZE = 512
# Tokens per latent tile inside a program (a [16, 512] tile of a DeepSeek latent
# is 32 KiB in float32 registers).
MLA_BLOCK_N = 16
# Query heads per program: all of them share each latent tile it loads.
MLA_HEAD_BLOCK = 16
# SCALES constexpr: how the stored codes are scaled.
_NO_SCALES, _TOKEN_SCALES, _STATIC_SCALES = 0, 1, 2


def _scales_code(cache: PagedKVCache) -> int:
    if cache.key_scale is None:
        return _NO_SCALES
    return _STATIC_SCALES if cache.static_scales else _TOKEN_SCALES


# --------------------------------------------------------------------------------------
# Torch reference
# --------------------------------------------------------------------------------------


def _gather_latents(
    cache: PagedKVCache, block_tables: torch.Tensor, rank: int
) -> torch.Tensor:
    """Dequantized latent rows [B, max_blocks * block_size, RANK + ROPE] float32 of
    every position the block tables [B, max_blocks] cover, a whole block at a
    time (padding entries -1 read block 0; the caller masks them by length)."""
    batch = block_tables.shape[0]
    blocks = block_tables.reshape(-1).clamp_min(0).long()  # [B * max_blocks]
    store = cache.key.view(cache.num_blocks, cache.block_size, cache.head_dim)
    raw = store.view(torch.uint8) if cache.stores_fp8 else store  # bytes are bytes
    rows = raw.index_select(0, blocks)  # [B * max_blocks, bs, dim]
    if cache.stores_fp8:
        rows = rows.view(torch.float8_e4m3fn)
    sizes = (rank, cache.head_dim - rank)
    if cache.key_scale is None:
        latents = rows.float()
    elif cache.static_scales:  # int8 / e4m3 latent, int8 RoPE key
        c = rows[..., :rank].float() * cache.key_scale.float()
        pe_scales = cache.rope_scale.index_select(0, blocks)  # [B * max_blocks, bs]
        pe_codes = rows[..., rank:].view(torch.uint8).view(torch.int8)
        latents = torch.cat((c, dequantize_kv(pe_codes, pe_scales, "int8")), -1)
    else:
        scales = cache.key_scale.index_select(0, blocks)  # [B * max_blocks, bs, 2]
        latents = torch.cat(
            [
                dequantize_kv(part, scales[..., i], cache.dtype)
                for i, part in enumerate(rows.split(sizes, dim=-1))
            ],
            dim=-1,
        )
    return latents.view(batch, -1, cache.head_dim)


def mla_decode_attention_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Torch reference of `mla_decode_attention` (float32 math, vectorised)."""
    rank = q_lat.shape[-1]
    latents = _gather_latents(cache, block_tables.to(q_lat.device), rank)
    c, k_pe = latents.split((rank, cache.head_dim - rank), dim=-1)  # [B, L, *]
    scores = torch.einsum("bhr,blr->bhl", q_lat.float(), c)
    scores = scores + torch.einsum("bhd,bld->bhl", q_pe.float(), k_pe)
    scores = scores * softmax_scale  # [B, H, L]
    pos = torch.arange(latents.shape[1], device=q_lat.device)  # [L]
    valid = pos[None, :] < context_lens.to(q_lat.device).long()[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    # A sequence with context 0 has no keys: define its output as 0, not NaN.
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)
    return torch.einsum("bhl,blr->bhr", probs, c).to(q_lat.dtype)


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _load_latent_part(
    cache_ptr,  # [num_slots, DIM] latent storage: bf16/fp16/fp32, int8, fp8 as u8
    slot,  # [BLOCK_N] int64 slot of each token
    mask,  # [BLOCK_N] tokens inside the partition
    OFFSET: tl.constexpr,  # first column of the part (0: c, RANK: k_pe)
    WIDTH: tl.constexpr,  # columns of the part
    WIDTH_PAD: tl.constexpr,  # WIDTH padded to a power of two >= 16
    DIM: tl.constexpr,
    KV_DTYPE: tl.constexpr,  # as the kernel's; -1: int8 codes (in u8: fp8's RoPE key)
):
    """[BLOCK_N, WIDTH_PAD] float32 codes (unscaled), 0 past WIDTH and the mask."""
    offs = tl.arange(0, WIDTH_PAD)
    ptrs = cache_ptr + slot[:, None] * DIM + OFFSET + offs[None, :]
    raw = tl.load(ptrs, mask=mask[:, None] & (offs < WIDTH)[None, :], other=0)
    if KV_DTYPE == 1:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if KV_DTYPE == -1:
        return raw.to(tl.int8, bitcast=True).to(tl.float32)
    return raw.to(tl.float32)


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr,  # [B, num_heads, RANK] absorbed queries (W_UK^T q_nope), contiguous
    q_pe_ptr,  # [B, num_heads, ROPE] rotated RoPE queries, contiguous
    cache_ptr,  # [num_slots, RANK + ROPE] latent rows (fp8 as u8)
    scale_ptr,  # [num_slots, 2] float16 token scales, or [1] float32 static (dummy)
    rope_scale_ptr,  # [num_slots] float16 RoPE-key scales (int8, fp8; else dummy)
    block_tables_ptr,  # [B, max_blocks] int32 physical block of each logical block
    context_lens_ptr,  # [B] int32 tokens in the cache per sequence
    part_out_ptr,  # [B, num_heads, num_parts, RANK_PAD] float32 unnormalised outputs
    part_max_ptr,  # [B, num_heads, num_parts] float32 running max of the scores
    part_sum_ptr,  # [B, num_heads, num_parts] float32 softmax denominators
    out_ptr,  # [B, num_heads, RANK_PAD] output (query dtype), when SINGLE_PART
    softmax_scale,
    num_heads,
    stride_bt,
    num_parts,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    KV_DTYPE: tl.constexpr,  # kv_quant.KV_DTYPE_CODES: 0 cast, 1 fp8, 2 int8
    # 0 none, 1 per token and part, 2 static latent + int8 RoPE key per token
    # (int8, fp8)
    SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SINGLE_PART: tl.constexpr,
):
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)

    offs_h = head_block * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    h_mask = offs_h < num_heads
    offs_r = tl.arange(0, RANK_PAD)
    offs_e = tl.arange(0, ROPE_PAD)
    q_row = (seq * num_heads + offs_h).to(tl.int64)  # [HEAD_BLOCK]
    q_lat = tl.load(
        q_lat_ptr + q_row[:, None] * RANK + offs_r[None, :],
        mask=h_mask[:, None] & (offs_r < RANK)[None, :],
        other=0.0,
    ).to(tl.float32)
    q_pe = tl.load(
        q_pe_ptr + q_row[:, None] * ROPE + offs_e[None, :],
        mask=h_mask[:, None] & (offs_e < ROPE)[None, :],
        other=0.0,
    ).to(tl.float32)
    q_lat = q_lat * softmax_scale
    q_pe = q_pe * softmax_scale
    if SCALES == 2:
        # One latent scale for the whole cache: into the query (and the output)
        c_static = tl.load(scale_ptr)
        q_lat = q_lat * c_static

    m_i = tl.full([HEAD_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([HEAD_BLOCK], tl.float32)
    acc = tl.zeros([HEAD_BLOCK, RANK_PAD], tl.float32)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, context_len)
    for tok0 in range(start, end, BLOCK_N):
        offs_n = tok0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(
            block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE,
            mask=n_mask,
            other=0,
        ).to(tl.int64)
        slot = block * BLOCK_SIZE + offs_n % BLOCK_SIZE  # [BLOCK_N]
        c = _load_latent_part(
            cache_ptr, slot, n_mask, 0, RANK, RANK_PAD, RANK + ROPE, KV_DTYPE
        )  # [BLOCK_N, RANK_PAD]
        if SCALES == 2:  # int8 / fp8: the RoPE key is int8
            k_pe = _load_latent_part(
                cache_ptr, slot, n_mask, RANK, ROPE, ROPE_PAD, RANK + ROPE, -1
            )  # [BLOCK_N, ROPE_PAD]
        else:
            k_pe = _load_latent_part(
                cache_ptr, slot, n_mask, RANK, ROPE, ROPE_PAD, RANK + ROPE, KV_DTYPE
            )
        s_c = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s_pe = tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        if SCALES == 1:
            c_scale = tl.load(scale_ptr + slot * 2, mask=n_mask, other=0.0)
            c_scale = c_scale.to(tl.float32)
            pe_scale = tl.load(scale_ptr + slot * 2 + 1, mask=n_mask, other=0.0)
            scores = s_c * c_scale[None, :] + s_pe * pe_scale.to(tl.float32)[None, :]
        elif SCALES == 2:
            pe_scale = tl.load(rope_scale_ptr + slot, mask=n_mask, other=0.0)
            scores = s_c + s_pe * pe_scale.to(tl.float32)[None, :]
        else:
            scores = s_c + s_pe  # [HEAD_BLOCK, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SCALES == 1:
            p = p * c_scale[None, :]  # the latent's dequantization, per token
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision=DOT_PRECISION)
        m_i = m_new
    if SCALES == 2:
        acc = acc * c_static

    if SINGLE_PART:
        # One partition holds the whole context: normalise here, skip the merge.
        inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        o_ptrs = out_ptr + q_row[:, None] * RANK_PAD + offs_r[None, :]
        o = acc * inv_l[:, None]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        part_row = q_row * num_parts + part  # [HEAD_BLOCK]
        tl.store(part_max_ptr + part_row, m_i, mask=h_mask)
        tl.store(part_sum_ptr + part_row, l_i, mask=h_mask)
        o_ptrs = part_out_ptr + part_row[:, None] * RANK_PAD + offs_r[None, :]
        tl.store(o_ptrs, acc, mask=h_mask[:, None])


def _pad(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def num_warps(rank_pad: int) -> int:
    """Warps per program: 8 for a DeepSeek-sized latent (its [HEAD_BLOCK, 512]
    accumulator and query and a [BLOCK_N, 512] tile in float32 registers)."""
    return 8 if rank_pad >= 256 else 4


def _mla_decode_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    partition_size: int = PARTITION_SIZE,
    block_n: int = MLA_BLOCK_N,
    head_block: int = MLA_HEAD_BLOCK,
) -> torch.Tensor:
    check(
        q_lat.is_contiguous() and q_pe.is_contiguous(),
        "q_lat and q_pe must be contiguous [B, num_heads, *]",
    )
    check(cache.key.is_contiguous(), "cache storage must be contiguous")
    check(block_tables.dtype == torch.int32, "block_tables must be int32")
    check(context_lens.dtype == torch.int32, "context_lens must be int32")
    check(block_tables.stride(-1) == 1, "block_tables rows must be contiguous")
    check(context_lens.is_contiguous(), "context_lens must be contiguous")
    check(
        block_n >= 16 and partition_size % block_n == 0,
        "partition_size must be a multiple of block_n >= 16",
    )
    check(
        head_block >= 16 and head_block & (head_block - 1) == 0,
        f"head_block must be a power of two >= 16, got {head_block}",
    )
    batch, num_heads, rank = q_lat.shape
    rope = cache.head_dim - rank
    rank_pad = _pad(rank)
    # Upper bound on the context from the table width: no device->host sync here;
    # partitions past a sequence's end exit at once.
    max_context = block_tables.shape[1] * cache.block_size
    num_parts = max(1, triton.cdiv(max_context, partition_size))
    dev = q_lat.device
    parts_shape = (batch, num_heads, num_parts) if num_parts > 1 else (1, 1, 1)
    part_out = torch.empty((*parts_shape, rank_pad), dtype=torch.float32, device=dev)
    part_max = torch.empty(parts_shape, dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    out = torch.empty((batch, num_heads, rank_pad), dtype=q_lat.dtype, device=dev)
    if batch == 0:
        return out[..., :rank]
    store = cache.key.view(torch.uint8) if cache.stores_fp8 else cache.key
    scale = cache.key_scale if cache.key_scale is not None else store
    rope_scale = cache.rope_scale if cache.rope_scale is not None else store
    _mla_decode_kernel[(triton.cdiv(num_heads, head_block), batch, num_parts)](
        q_lat,
        q_pe,
        store,
        scale,
        rope_scale,
        block_tables,
        context_lens,
        part_out,
        part_max,
        part_sum,
        out,
        softmax_scale,
        num_heads,
        block_tables.stride(0),
        num_parts,
        RANK=rank,
        ROPE=rope,
        RANK_PAD=rank_pad,
        ROPE_PAD=_pad(rope),
        HEAD_BLOCK=head_block,
        BLOCK_SIZE=cache.block_size,
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        KV_DTYPE=KV_DTYPE_CODES[cache.dtype],
        SCALES=_scales_code(cache),
        DOT_PRECISION=_dot_precision(cache),
        SINGLE_PART=num_parts == 1,
        num_warps=num_warps(rank_pad),
    )
    if num_parts > 1:
        reduce_partitions(part_out, part_max, part_sum, out, num_parts)
    return out if rank_pad == rank else out[..., :rank]


# --------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------


def mla_decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    impl: str = "auto",
) -> torch.Tensor:
    """Absorbed MLA decode: q_lat [B, H, RANK] (W_UK^T q_nope) and q_pe [B, H, ROPE]
    (rotated) -> the attention-weighted latent [B, H, RANK] (q_lat's dtype; the
    caller applies W_UV).

    `cache` is one layer's latent cache (module docstring), RANK + ROPE values per
    token; block_tables [B, max_blocks] int32, context_lens [B] int32 (tokens in
    the cache, the new token's latent already written). softmax_scale multiplies
    both parts of the score (YaRN's mscale^2 included where the model has it).
    Triton on CUDA, torch reference elsewhere (`impl`).
    """
    check(
        cache.dtype in MLA_KERNEL_DTYPES,
        f"KV cache dtype {cache.dtype!r} is not supported for MLA's latent cache "
        f"(supported: {', '.join(MLA_KERNEL_DTYPES)})",
    )
    check(
        cache.num_kv_heads == 1 and cache.value.shape[-1] == 0 and not cache.window,
        "not an MLA latent cache (one row of latent + RoPE key per token, no value, "
        "no window)",
    )
    check(
        q_lat.dim() == 3 and q_pe.dim() == 3 and q_lat.shape[:2] == q_pe.shape[:2],
        f"q_lat and q_pe must be [B, H, *] alike, got {tuple(q_lat.shape)} and "
        f"{tuple(q_pe.shape)}",
    )
    check(
        q_lat.shape[2] + q_pe.shape[2] == cache.head_dim,
        f"RANK {q_lat.shape[2]} + ROPE {q_pe.shape[2]} != the cache's row of "
        f"{cache.head_dim}",
    )
    check(
        q_lat.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and q_pe.dtype == q_lat.dtype,
        f"q_lat and q_pe must share a bf16/fp16/fp32 dtype, got {q_lat.dtype} and "
        f"{q_pe.dtype}",
    )
    check(block_tables.dim() == 2, "block_tables must be [B, max_blocks]")
    check(
        block_tables.shape[0] == q_lat.shape[0] == context_lens.shape[0],
        "q_lat, block_tables and context_lens disagree on the batch size",
    )
    if use_triton(impl, q_lat, q_pe, cache.key, block_tables, context_lens):
        return _mla_decode_triton(
            q_lat, q_pe, cache, block_tables, context_lens, softmax_scale
        )
    return mla_decode_attention_reference(
        q_lat, q_pe, cache, block_tables, context_lens, softmax_scale
    )
