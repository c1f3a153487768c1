"""Paged attention over a (quantized) paged KV cache: decode and chunked prefill.

Decode: one query token per sequence, K/V read through the block table, grouped-query
attention (query head h uses kv head h // (num_heads // num_kv_heads)). The Triton
kernel runs one program per (sequence, kv head, context partition of PARTITION_SIZE
tokens): all query heads of the group share each K/V tile, which is gathered token
by token through the block table (so any block size and any context length work),
dequantized in registers just before each dot, and folded in with an online softmax
in float32. A second small kernel merges the partitions (flash-decoding style).
int4 has its own copy of the kernel that keeps the packed bytes contiguous: it splits
q, K, V and the output into even and odd head_dim elements (low and high nibbles),
so q.k = q_even.k_even + q_odd.k_odd and no interleave is ever materialised.

Prefill: new token i of sequence b sits at position context_lens[b] - n_new_b + i and
attends to every cache position <= its own (the cached prefix plus the causal part of
its chunk). The reference uses SDPA per sequence; the Triton kernel is flash-attention
over the paged cache: one program per (tile of PREFILL_BLOCK_M new tokens of one
sequence, query head), K/V tiles gathered through the block table up to the tile's
last position, causal mask by absolute position. The query heads of a GQA group each
read their kv head (from L2 after the first).

Full-precision window (kernels/kv_quant.py), per query: the query at position p
reads positions p - window + 1 .. p in full precision and every older one from its
quantized block, whatever the chunk it comes in. Decode (p = context_lens[b] - 1)
reads them from the sequence's window row, written before attention. Prefill takes
the chunk's own K/V (`key`/`value`, as written) for the positions of the chunk and
the window row, written *after* prefill attention (`kv_quant.write_window`), for the
window - 1 positions before it; the kernels load both precisions of a tile and
select per (query, key) pair, and compile the old code when WINDOW == 0. So
chunked and unchunked prefill give the same logprobs.

int4c (`kv_quant.CENTERED_DTYPES`, written by `gpuagent.engine.kv_int4c`) runs the
int4 paths with three changes: its codes read the 16 Gaussian levels
(`kv_gauss.gauss_level`, a select tree in registers, no table in memory); a
quantized key is stored less m_p = RoPE_p(mean) R (the layer's key mean RoPE'd to
the key's position p, in the model's dtype, then rotated), so its score gains
q R . m_p = q . RoPE_p(mean), computed per tile from the query in the model's
basis (q R R: R is symmetric), the mean and cos/sin of p, rounded as the model
rounds RoPE; and its window row keeps the newest WINDOW - 1 positions (ring slot
p % (WINDOW - 1)) and position 0 in its last slot, both read in bf16. Their torch
reference is the engine's (`kv_int4c`): the ops' reference path refuses int4c.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels._triton import check, tl, triton, use_triton
from kernels.kv_gauss import gauss_level
from kernels.kv_quant import (
    CENTERED_DTYPES,
    KV_DTYPE_CODES,
    WINDOW_DTYPE,
    PagedKVCache,
    dequantize_kv,
    fp32_to_bf16_rne,
    hadamard,
    overlay_window,
    refuse_centered,
    window_kernel_args,
)

# Tokens per decode program; 512 matches vLLM's paged-attention v2 partitions.
PARTITION_SIZE = 512
# Tokens per K/V tile inside a program.
DECODE_BLOCK_N = 64
# Prefill: new tokens per query tile, cached tokens per K/V tile.
PREFILL_BLOCK_M = 32
PREFILL_BLOCK_N = 32
# ROPE_DTYPE constexpr codes: the dtype the model RoPEs keys in (int4c's mean term
# rounds as it does).
ROPE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _dot_precision(cache: PagedKVCache) -> str:
    # The dots multiply float32 tiles; CUDA's default TF32 (10-bit mantissa) would
    # undo an fp32 cache, whose only purpose is float32-exact parity checks.
    return "ieee" if cache.dtype == "fp32" else "tf32"


# --------------------------------------------------------------------------------------
# Torch reference
# --------------------------------------------------------------------------------------


def _gather_context(
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    window_rows: torch.Tensor | None,
):
    """Dequantized K, V [B, max_blocks * block_size, Hkv, D] float32: every position
    the block tables [B, max_blocks] cover, gathered a whole block at a time, with
    each sequence's newest positions (before context_lens) from its full-precision
    window when `window_rows` is given."""
    batch = block_tables.shape[0]
    # Padding entries of a block table may be -1; they are masked out by length.
    blocks = block_tables.reshape(-1).clamp_min(0)  # [B * max_blocks]
    out = []
    for store, scale in (
        (cache.key, cache.key_scale),
        (cache.value, cache.value_scale),
    ):
        # index_select copies whole blocks, several times faster on the CPU than
        # store[table]; fp8 travels as bytes (bytes are bytes).
        raw = store.view(torch.uint8) if cache.stores_fp8 else store
        rows = raw.index_select(0, blocks)  # [B * max_blocks, bs, Hkv, D or D/2]
        if cache.stores_fp8:
            rows = rows.view(torch.float8_e4m3fn)
        if scale is None or cache.static_scales:
            s = scale  # None, or [Hkv] for every slot
        else:
            s = scale.index_select(0, blocks)
        x = dequantize_kv(rows, s, cache.dtype)  # [B * max_blocks, bs, Hkv, D]
        out.append(x.view(batch, -1, cache.num_kv_heads, cache.head_dim))
    key, value = out
    if cache.window and window_rows is not None:
        overlay_window(cache, key, value, context_lens, window_rows)
    return key, value


def paged_decode_attention_reference(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    window_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `paged_decode_attention` (float32 math, vectorised)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    key, value = _gather_context(
        cache, block_tables.to(query.device), context_lens, window_rows
    )  # [B, L, Hkv, D]
    # The `group` query heads of one kv head act as `group` query rows against that
    # head's keys, so GQA needs no repeated K/V.
    q = query.float().view(batch, num_kv_heads, group, head_dim)
    pos = torch.arange(key.shape[1], device=query.device)  # [L]
    valid = pos[None, :] < context_lens.to(query.device).long()[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q,  # [B, Hkv, group, D]
        key.transpose(1, 2),  # [B, Hkv, L, D]
        value.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=softmax_scale,
    )  # [B, Hkv, group, D]
    # A sequence with context 0 has no keys: define its output as 0, not NaN.
    out = torch.nan_to_num(out, nan=0.0)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention_reference(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    window_rows: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `paged_prefill_attention` (float32, one SDPA for the whole
    batch: queries padded to [B, max_new], K/V to [B, max_blocks * block_size]; with
    a window, the full-precision copy of the context follows the quantized one, and
    each (query, key) pair is masked into exactly one of the two)."""
    num_tokens, num_heads, head_dim = query.shape
    device = query.device
    batch = context_lens.shape[0]
    if num_tokens == 0:
        return torch.empty_like(query)
    qsl = query_start_loc.to(device).long()
    ctx = context_lens.to(device).long()  # [B]
    num_new = qsl[1:] - qsl[:-1]  # [B]
    max_new = int(num_new.max())
    # Token t of the flat batch is row `row[t]` of sequence `seq[t]`.
    seq = torch.repeat_interleave(torch.arange(batch, device=device), num_new)  # [T]
    row = torch.arange(num_tokens, device=device) - qsl[seq]  # [T]
    q = query.new_zeros((batch, max_new, num_heads, head_dim), dtype=torch.float32)
    q[seq, row] = query.float()
    keys, values = _gather_context(
        cache, block_tables.to(device), ctx, None
    )  # [B, L, Hkv, D]
    # New token i of seq b sits at ctx[b] - num_new[b] + i; it sees positions up to
    # its own. Padding rows see something harmless and are dropped below.
    start = ctx - num_new  # [B] position of each chunk's first token
    q_pos = start[:, None] + torch.arange(max_new, device=device)  # [B, N]
    k_pos = torch.arange(keys.shape[1], device=device)  # [L]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < ctx[:, None, None]
    )  # [B, N, L]
    if cache.window:
        # Full precision: the window row holds the positions before the chunk (it is
        # written after this), `key`/`value` the chunk's own.
        full_k, full_v = keys.clone(), values.clone()
        overlay_window(cache, full_k, full_v, start, window_rows)
        # rounded to the window's bf16, as the window row will hold them
        full_k[seq, start[seq] + row] = key.to(WINDOW_DTYPE).float()
        full_v[seq, start[seq] + row] = value.to(WINDOW_DTYPE).float()
        recent = (q_pos[:, :, None] - k_pos[None, None, :]) < cache.window  # [B,N,L]
        # Position j's two copies side by side (2j quantized, 2j + 1 full), each
        # query masked to one: where a position sits doesn't depend on how far the
        # block tables reach, so neither does SDPA's summation order.
        mask = torch.stack((mask & ~recent, mask & recent), dim=-1).flatten(-2)
        keys = torch.stack((keys, full_k), dim=2).flatten(1, 2)  # [B, 2L, Hkv, D]
        values = torch.stack((values, full_v), dim=2).flatten(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [B, H, N, D]
        keys.transpose(1, 2),  # [B, Hkv, L, D]
        values.transpose(1, 2),
        attn_mask=mask[:, None],  # [B, 1, N, L]
        scale=softmax_scale,
        enable_gqa=cache.num_kv_heads != num_heads,
    )  # [B, H, N, D]
    return out.transpose(1, 2)[seq, row].to(query.dtype)  # [T, H, D]


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    cache_ptr,  # [num_slots * Hkv, HEAD_DIM] storage: bf16/fp16/fp32, fp8 as u8, int8
    scale_ptr,  # [num_slots * Hkv] float16 scales (unused when KV_DTYPE == 0)
    row,  # [BLOCK_N] int64 row (slot * Hkv + kv_head) of each token
    scale_row,  # [BLOCK_N] its scale's index: row, or kv_head for static scales
    mask,  # [BLOCK_N] tokens inside the context
    HEAD_DIM: tl.constexpr,
    KV_DTYPE: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = cache_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
    raw = tl.load(ptrs, mask=mask[:, None], other=0)
    if KV_DTYPE == 1:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = raw.to(tl.float32)
    if KV_DTYPE != 0:
        scale = tl.load(scale_ptr + scale_row, mask=mask, other=0.0).to(tl.float32)
        x = x * scale[:, None]
    return x


@triton.jit
def _load_window_tile(
    window_ptr,  # [num_windows * WINDOW * Hkv, HEAD_DIM] bfloat16 ring of K or V
    ring,  # [BLOCK_N] int64 ring row of each token (slot in the ring * Hkv + kv_head)
    mask,  # [BLOCK_N] tokens read from the window
    HEAD_DIM: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = window_ptr + ring[:, None] * HEAD_DIM + offs_d[None, :]
    return tl.load(ptrs, mask=mask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, num_heads, HEAD_DIM] queries, contiguous
    k_cache_ptr,  # key storage, [num_slots, Hkv, HEAD_DIM or HEAD_DIM//2]
    v_cache_ptr,  # value storage, same layout
    k_scale_ptr,  # [num_slots, Hkv] float16 key scales (dummy: unscaled)
    v_scale_ptr,  # [num_slots, Hkv] float16 value scales (dummy: unscaled)
    block_tables_ptr,  # [B, max_blocks] int32 physical block of each logical block
    context_lens_ptr,  # [B] int32 tokens in the cache per sequence
    window_rows_ptr,  # [B] int32 window row of each sequence (dummy: WINDOW == 0)
    k_window_ptr,  # [num_windows * WINDOW, Hkv, HEAD_DIM] bfloat16 keys (dummy)
    v_window_ptr,  # [num_windows * WINDOW, Hkv, HEAD_DIM] bfloat16 values (dummy)
    part_out_ptr,  # [B, num_heads, num_parts, HEAD_DIM] float32 unnormalised outputs
    part_max_ptr,  # [B, num_heads, num_parts] float32 running max of the scores
    part_sum_ptr,  # [B, num_heads, num_parts] float32 softmax denominators
    out_ptr,  # [B, num_heads, HEAD_DIM] output (query dtype), when SINGLE_PART
    softmax_scale,
    num_kv_heads,
    stride_bt,
    num_parts,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    KV_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SINGLE_PART: tl.constexpr,
    WINDOW: tl.constexpr,  # full-precision window length; 0 = none
    STATIC_SCALES: tl.constexpr,  # one scale per kv head (fp8)
):
    # kv heads vary fastest across programs: the heads of one token share DRAM pages
    # and the 32-byte sectors of their scales.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    num_heads = num_kv_heads * GROUP

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    head = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads of this kv head
    q_ptrs = q_ptr + (seq * num_heads + head)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0).to(tl.float32)
    q = q * softmax_scale

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, context_len)
    if WINDOW > 0:
        window_row = tl.load(window_rows_ptr + seq).to(tl.int64)
    for tok0 in range(start, end, BLOCK_N):
        offs_n = tok0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        paged = n_mask  # [BLOCK_N] tokens read from the (quantized) blocks
        if WINDOW > 0:
            # Positions >= context_len - WINDOW come from the bf16 ring instead.
            win = n_mask & (offs_n >= context_len - WINDOW)
            paged = n_mask & (offs_n < context_len - WINDOW)
            ring = (window_row * WINDOW + offs_n % WINDOW) * num_kv_heads + kv_head
        block = tl.load(
            block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE,
            mask=paged,
            other=0,
        ).to(tl.int64)
        row = (block * BLOCK_SIZE + offs_n % BLOCK_SIZE) * num_kv_heads + kv_head
        scale_row = row * 0 + kv_head if STATIC_SCALES else row
        k = _load_kv_tile(
            k_cache_ptr, k_scale_ptr, row, scale_row, paged, HEAD_DIM, KV_DTYPE
        )
        if WINDOW > 0:
            k_win = _load_window_tile(k_window_ptr, ring, win, HEAD_DIM)
            k = tl.where(win[:, None], k_win, k)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            v_cache_ptr, v_scale_ptr, row, scale_row, paged, HEAD_DIM, KV_DTYPE
        )
        if WINDOW > 0:
            v_win = _load_window_tile(v_window_ptr, ring, win, HEAD_DIM)
            v = tl.where(win[:, None], v_win, v)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_PART:
        # One partition holds the whole context: normalise here, skip the merge.
        inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        o_ptrs = (
            out_ptr + (seq * num_heads + head)[:, None] * HEAD_DIM + offs_d[None, :]
        )
        o = acc * inv_l[:, None]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        part_row = (seq * num_heads + head) * num_parts + part  # [GROUP_PAD]
        tl.store(part_max_ptr + part_row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part_row, l_i, mask=g_mask)
        out_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(out_ptrs, acc, mask=g_mask[:, None])


@triton.jit
def _load_int4_tile(
    cache_ptr,  # [num_slots * Hkv, HEAD_DIM // 2] uint8, element 2j low nibble of j
    scale_ptr,  # [num_slots * Hkv] float16 scales
    row,  # [BLOCK_N] int64 row (slot * Hkv + kv_head) of each token
    mask,  # [BLOCK_N] tokens inside the context
    HEAD_DIM: tl.constexpr,
    GAUSS: tl.constexpr,  # int4c's Gaussian levels instead of u - 7.5
):
    # Contiguous byte rows (vectorised loads); the even and odd elements come back
    # as two [BLOCK_N, HEAD_DIM // 2] halves so no interleave is needed.
    offs_j = tl.arange(0, HEAD_DIM // 2)
    ptrs = cache_ptr + row[:, None] * (HEAD_DIM // 2) + offs_j[None, :]
    byte = tl.load(ptrs, mask=mask[:, None], other=0).to(tl.int32)
    scale = tl.load(scale_ptr + row, mask=mask, other=0.0).to(tl.float32)[:, None]
    if GAUSS:
        even = gauss_level(byte & 0xF) * scale
        odd = gauss_level(byte >> 4) * scale
    else:
        even = ((byte & 0xF).to(tl.float32) - 7.5) * scale
        odd = ((byte >> 4).to(tl.float32) - 7.5) * scale
    return even, odd


@triton.jit
def _load_window_tile_split(
    window_ptr,  # [num_windows * WINDOW * Hkv, HEAD_DIM] bfloat16 ring of K or V
    ring,  # [BLOCK_N] int64 ring row of each token (slot in the ring * Hkv + kv_head)
    mask,  # [BLOCK_N] tokens read from the window
    HEAD_DIM: tl.constexpr,
):
    # The int4 kernel's even/odd split of head_dim: two [BLOCK_N, HEAD_DIM // 2]
    # stride-2 loads (the odd one hits the sectors the even one brought in).
    offs_j = tl.arange(0, HEAD_DIM // 2)
    ptrs = window_ptr + ring[:, None] * HEAD_DIM + 2 * offs_j[None, :]
    even = tl.load(ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
    odd = tl.load(ptrs + 1, mask=mask[:, None], other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def _round_as(x, ROPE_DTYPE: tl.constexpr):
    # float32 x rounded to the model's dtype (ROPE_DTYPE_CODES) and back
    if ROPE_DTYPE == 1:
        x = fp32_to_bf16_rne(x).to(tl.float32)
    elif ROPE_DTYPE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _key_mean_scores(
    qm_lo,  # [M, HEAD_DIM // 2] float32 first halves of the queries (model basis)
    qm_hi,  # [M, HEAD_DIM // 2] float32 second halves
    key_mean_ptr,  # [Hkv, HEAD_DIM] float32 key means before RoPE
    inv_freq_ptr,  # [HEAD_DIM // 2] float32 RoPE inverse frequencies
    kv_head,
    pos,  # [BLOCK_N] positions of the keys
    HEAD_DIM: tl.constexpr,
    ROPE_DTYPE: tl.constexpr,
):
    """[M, BLOCK_N] q . RoPE_p(mean), int4c's score term of a quantized key at p:
    HF's RoPE on halves (lo cos - hi sin, hi cos + lo sin), each op rounded to the
    model's dtype as `apply_rope` rounds it."""
    offs_j = tl.arange(0, HEAD_DIM // 2)
    mean_row = key_mean_ptr + kv_head * HEAD_DIM
    m_lo = _round_as(tl.load(mean_row + offs_j), ROPE_DTYPE)[None, :]
    m_hi = _round_as(tl.load(mean_row + HEAD_DIM // 2 + offs_j), ROPE_DTYPE)[None, :]
    inv_freq = tl.load(inv_freq_ptr + offs_j)
    freqs = pos.to(tl.float32)[:, None] * inv_freq[None, :]  # [BLOCK_N, D // 2]
    cos = _round_as(tl.cos(freqs), ROPE_DTYPE)
    sin = _round_as(tl.sin(freqs), ROPE_DTYPE)
    lo_cos = _round_as(m_lo * cos, ROPE_DTYPE)
    hi_sin = _round_as(m_hi * sin, ROPE_DTYPE)
    hi_cos = _round_as(m_hi * cos, ROPE_DTYPE)
    lo_sin = _round_as(m_lo * sin, ROPE_DTYPE)
    r_lo = _round_as(lo_cos - hi_sin, ROPE_DTYPE)  # [BLOCK_N, D // 2]
    r_hi = _round_as(hi_cos + lo_sin, ROPE_DTYPE)
    # float32 dots: the mean is the bulk of a centered key, tf32 would blur it
    scores = tl.dot(qm_lo, tl.trans(r_lo), input_precision="ieee")
    return scores + tl.dot(qm_hi, tl.trans(r_hi), input_precision="ieee")


@triton.jit
def _window_ring_row(
    window_row,  # int64 window row of the sequence
    offs_n,  # [BLOCK_N] positions
    num_kv_heads,
    kv_head,
    WINDOW: tl.constexpr,
    SINK: tl.constexpr,  # int4c: position 0 in the row's last slot
):
    # Row of each position's bf16 copy: ring slot p % WINDOW, or with a sink
    # p % (WINDOW - 1) and position 0 in slot WINDOW - 1.
    if SINK:
        slot = tl.where(offs_n == 0, WINDOW - 1, offs_n % (WINDOW - 1))
    else:
        slot = offs_n % WINDOW
    return (window_row * WINDOW + slot) * num_kv_heads + kv_head


@triton.jit
def _paged_decode_int4_kernel(
    q_ptr,  # [B, num_heads, HEAD_DIM] queries, contiguous
    k_cache_ptr,  # [num_slots, Hkv, HEAD_DIM // 2] uint8 packed key nibbles
    v_cache_ptr,  # [num_slots, Hkv, HEAD_DIM // 2] uint8 packed value nibbles
    k_scale_ptr,  # [num_slots, Hkv] float16 key scales
    v_scale_ptr,  # [num_slots, Hkv] float16 value scales
    block_tables_ptr,  # [B, max_blocks] int32 physical block of each logical block
    context_lens_ptr,  # [B] int32 tokens in the cache per sequence
    window_rows_ptr,  # [B] int32 window row of each sequence (dummy: WINDOW == 0)
    k_window_ptr,  # [num_windows * WINDOW, Hkv, HEAD_DIM] bfloat16 keys (dummy)
    v_window_ptr,  # [num_windows * WINDOW, Hkv, HEAD_DIM] bfloat16 values (dummy)
    part_out_ptr,  # [B, num_heads, num_parts, HEAD_DIM] float32 unnormalised outputs
    part_max_ptr,  # [B, num_heads, num_parts] float32 running max of the scores
    part_sum_ptr,  # [B, num_heads, num_parts] float32 softmax denominators
    out_ptr,  # [B, num_heads, HEAD_DIM] output (query dtype), when SINGLE_PART
    q_model_ptr,  # [B, num_heads, HEAD_DIM] float32 queries unrotated (int4c; dummy)
    key_mean_ptr,  # [Hkv, HEAD_DIM] float32 key means (int4c; dummy)
    inv_freq_ptr,  # [HEAD_DIM // 2] float32 RoPE inverse frequencies (int4c; dummy)
    softmax_scale,
    num_kv_heads,
    stride_bt,
    num_parts,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SINGLE_PART: tl.constexpr,
    WINDOW: tl.constexpr,  # full-precision window length; 0 = none
    CENTERED: tl.constexpr,  # int4c (module docstring)
    ROPE_DTYPE: tl.constexpr,  # int4c: ROPE_DTYPE_CODES of the model's dtype
):
    # Same as _paged_decode_kernel, with q, K, V and the output split into even and
    # odd head_dim elements: q.k = q_even.k_even + q_odd.k_odd.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    num_heads = num_kv_heads * GROUP

    offs_g = tl.arange(0, GROUP_PAD)
    offs_j = tl.arange(0, HEAD_DIM // 2)
    g_mask = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + (seq * num_heads + head)[:, None] * HEAD_DIM + 2 * offs_j[None, :]
    q_even = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0).to(tl.float32)
    q_odd = tl.load(q_ptrs + 1, mask=g_mask[:, None], other=0.0).to(tl.float32)
    q_even = q_even * softmax_scale
    q_odd = q_odd * softmax_scale
    if CENTERED:
        # the query in the model's basis, as halves (RoPE's pairs are j, j + D/2)
        qm_ptrs = q_model_ptr + (seq * num_heads + head)[:, None] * HEAD_DIM
        qm_ptrs += offs_j[None, :]
        qm_lo = tl.load(qm_ptrs, mask=g_mask[:, None], other=0.0) * softmax_scale
        qm_hi = tl.load(qm_ptrs + HEAD_DIM // 2, mask=g_mask[:, None], other=0.0)
        qm_hi = qm_hi * softmax_scale
    # int4c's ring holds the newest WINDOW - 1 positions, position 0 beside them
    RING: tl.constexpr = WINDOW - CENTERED

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc_even = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)
    acc_odd = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, context_len)
    if WINDOW > 0:
        window_row = tl.load(window_rows_ptr + seq).to(tl.int64)
    for tok0 in range(start, end, BLOCK_N):
        offs_n = tok0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        paged = n_mask  # [BLOCK_N] tokens read from the (quantized) blocks
        if WINDOW > 0:
            # Positions >= context_len - RING (and int4c's 0) from the bf16 row.
            win = n_mask & (offs_n >= context_len - RING)
            if CENTERED:
                win = win | (n_mask & (offs_n == 0))
            paged = n_mask & ~win
            ring = _window_ring_row(
                window_row, offs_n, num_kv_heads, kv_head, WINDOW, CENTERED
            )
        block = tl.load(
            block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE,
            mask=paged,
            other=0,
        ).to(tl.int64)
        row = (block * BLOCK_SIZE + offs_n % BLOCK_SIZE) * num_kv_heads + kv_head
        k_even, k_odd = _load_int4_tile(
            k_cache_ptr, k_scale_ptr, row, paged, HEAD_DIM, CENTERED
        )
        if WINDOW > 0:
            w_even, w_odd = _load_window_tile_split(k_window_ptr, ring, win, HEAD_DIM)
            k_even = tl.where(win[:, None], w_even, k_even)
            k_odd = tl.where(win[:, None], w_odd, k_odd)
        scores = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))
        if CENTERED:
            mean_scores = _key_mean_scores(
                qm_lo, qm_hi, key_mean_ptr, inv_freq_ptr, kv_head, offs_n,
                HEAD_DIM, ROPE_DTYPE,
            )  # fmt: skip
            scores += tl.where(paged[None, :], mean_scores, 0.0)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_even, v_odd = _load_int4_tile(
            v_cache_ptr, v_scale_ptr, row, paged, HEAD_DIM, CENTERED
        )
        if WINDOW > 0:
            w_even, w_odd = _load_window_tile_split(v_window_ptr, ring, win, HEAD_DIM)
            v_even = tl.where(win[:, None], w_even, v_even)
            v_odd = tl.where(win[:, None], w_odd, v_odd)
        acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even)
        acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd)
        m_i = m_new

    if SINGLE_PART:
        inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        o_ptrs = out_ptr + (seq * num_heads + head)[:, None] * HEAD_DIM
        o_ptrs += 2 * offs_j[None, :]
        even = (acc_even * inv_l[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(o_ptrs, even, mask=g_mask[:, None])
        odd = (acc_odd * inv_l[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(o_ptrs + 1, odd, mask=g_mask[:, None])
    else:
        part_row = (seq * num_heads + head) * num_parts + part  # [GROUP_PAD]
        tl.store(part_max_ptr + part_row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part_row, l_i, mask=g_mask)
        out_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM + 2 * offs_j[None, :]
        tl.store(out_ptrs, acc_even, mask=g_mask[:, None])
        tl.store(out_ptrs + 1, acc_odd, mask=g_mask[:, None])


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr,  # [B * num_heads, num_parts, HEAD_DIM] float32 partial outputs
    part_max_ptr,  # [B * num_heads, num_parts] float32 partial score maxima
    part_sum_ptr,  # [B * num_heads, num_parts] float32 partial denominators
    out_ptr,  # [B * num_heads, HEAD_DIM] attention output (query dtype)
    num_parts,
    HEAD_DIM: tl.constexpr,
    PARTS_BLOCK: tl.constexpr,
):
    bh = tl.program_id(0)
    offs_d = tl.arange(0, HEAD_DIM)
    # Pass 1: global max over partitions; empty partitions hold -inf.
    m_all = tl.full([PARTS_BLOCK], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, PARTS_BLOCK):
        offs_p = p0 + tl.arange(0, PARTS_BLOCK)
        m = tl.load(
            part_max_ptr + bh * num_parts + offs_p,
            mask=offs_p < num_parts,
            other=float("-inf"),
        )
        m_all = tl.maximum(m_all, m)
    m_max = tl.max(m_all, axis=0)
    # No tokens at all (context 0): any finite m_max keeps exp() NaN-free.
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    # Pass 2: rescale and sum.
    denom = tl.zeros([PARTS_BLOCK], tl.float32)
    acc = tl.zeros([PARTS_BLOCK, HEAD_DIM], tl.float32)
    for p0 in range(0, num_parts, PARTS_BLOCK):
        offs_p = p0 + tl.arange(0, PARTS_BLOCK)
        p_mask = offs_p < num_parts
        m = tl.load(
            part_max_ptr + bh * num_parts + offs_p, mask=p_mask, other=float("-inf")
        )
        s = tl.load(part_sum_ptr + bh * num_parts + offs_p, mask=p_mask, other=0.0)
        w = tl.where(s > 0, tl.exp(m - m_max), 0.0)
        denom += w * s
        o_ptrs = part_out_ptr + (bh * num_parts + offs_p)[:, None] * HEAD_DIM
        o = tl.load(o_ptrs + offs_d[None, :], mask=p_mask[:, None], other=0.0)
        acc += o * w[:, None]
    total = tl.sum(denom, axis=0)
    total = tl.where(total > 0, total, 1.0)
    out = tl.sum(acc, axis=0) / total
    tl.store(out_ptr + bh * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _hadamard_on(dim: int, device: torch.device) -> torch.Tensor:
    # one float32 Hadamard matrix per (size, device), made once; a normal tensor
    # even when first asked for under inference_mode
    with torch.inference_mode(False):
        return hadamard(dim, device)


def _centered_args(
    query: torch.Tensor,
    cache: PagedKVCache,
    rope: tuple[torch.Tensor, torch.dtype] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(query in the model's basis [.., H, D] float32, key mean [Hkv, D] float32,
    RoPE inverse frequencies [D/2] float32, ROPE_DTYPE code): the int4c kernels'
    mean-term arguments; dummies (and code 0) for any other layout."""
    if cache.dtype not in CENTERED_DTYPES:
        return query, query, query, 0
    inv_freq, dtype = rope
    # The rotated query q R back in the model's basis: R is symmetric, R R = I.
    query_model = (
        query.float() @ _hadamard_on(cache.head_dim, query.device)
    ).contiguous()
    inv_freq = inv_freq.to(device=query.device, dtype=torch.float32).contiguous()
    mean = cache.key_mean.contiguous()
    return query_model, mean, inv_freq, ROPE_DTYPE_CODES[dtype]


def _paged_decode_triton(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    window_rows: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.dtype] | None = None,
    partition_size: int = PARTITION_SIZE,
    block_n: int = DECODE_BLOCK_N,
) -> torch.Tensor:
    check(query.is_contiguous(), "query must be contiguous [B, num_heads, head_dim]")
    check(
        cache.key.is_contiguous() and cache.value.is_contiguous(),
        "cache storage must be contiguous",
    )
    check(block_tables.dtype == torch.int32, "block_tables must be int32")
    check(context_lens.dtype == torch.int32, "context_lens must be int32")
    check(block_tables.stride(-1) == 1, "block_tables rows must be contiguous")
    check(context_lens.is_contiguous(), "context_lens must be contiguous")
    head_dim = cache.head_dim
    check(
        head_dim >= 16 and head_dim & (head_dim - 1) == 0,
        f"Triton paged attention needs a power-of-two head_dim >= 16, got {head_dim}",
    )
    check(
        block_n >= 16 and partition_size % block_n == 0,
        "partition_size must be a multiple of block_n >= 16",
    )
    batch, num_heads, _ = query.shape
    group = num_heads // cache.num_kv_heads
    # Upper bound on the context from the table width: no device->host sync here;
    # partitions past a sequence's end exit at once.
    max_context = block_tables.shape[1] * cache.block_size
    num_parts = max(1, triton.cdiv(max_context, partition_size))
    dev = query.device
    # Partial results only when the context spans several partitions.
    parts_shape = (batch, num_heads, num_parts) if num_parts > 1 else (1, 1, 1)
    part_out = torch.empty((*parts_shape, head_dim), dtype=torch.float32, device=dev)
    part_max = torch.empty(parts_shape, dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    out = torch.empty_like(query)
    if batch == 0:
        return out
    key, value = cache.key, cache.value
    if cache.stores_fp8:
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    key_scale = cache.key_scale if cache.key_scale is not None else key
    value_scale = cache.value_scale if cache.value_scale is not None else value
    centered = cache.dtype in CENTERED_DTYPES
    int4 = cache.dtype == "int4" or centered
    kernel = _paged_decode_int4_kernel if int4 else _paged_decode_kernel
    rows, window_key, window_value = window_kernel_args(
        cache, window_rows, context_lens, "window_rows"
    )
    mean_args = _centered_args(query, cache, rope)
    if int4:
        dtype_arg = {"CENTERED": centered, "ROPE_DTYPE": mean_args[-1]}
    else:
        dtype_arg = {
            "KV_DTYPE": KV_DTYPE_CODES[cache.dtype],
            "DOT_PRECISION": _dot_precision(cache),
            "STATIC_SCALES": cache.static_scales,
        }
    kernel[(cache.num_kv_heads, batch, num_parts)](
        query,
        key,
        value,
        key_scale,
        value_scale,
        block_tables,
        context_lens,
        rows,
        window_key,
        window_value,
        part_out,
        part_max,
        part_sum,
        out,
        *(mean_args[:3] if int4 else ()),
        softmax_scale,
        cache.num_kv_heads,
        block_tables.stride(0),
        num_parts,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=cache.block_size,
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        **dtype_arg,
        SINGLE_PART=num_parts == 1,
        WINDOW=cache.window,
        num_warps=4,
    )
    if num_parts > 1:
        reduce_partitions(part_out, part_max, part_sum, out, num_parts)
    return out


def reduce_partitions(
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    out: torch.Tensor,
    num_parts: int,
) -> None:
    """Merges a split decode's partitions into `out` [batch, heads, width]: each
    partition's output [.., num_parts, width] weighted by its softmax max and sum
    (the paged Llama decode and the MLA decode both end so)."""
    batch, num_heads, width = out.shape
    _paged_decode_reduce_kernel[(batch * num_heads,)](
        part_out,
        part_max,
        part_sum,
        out,
        num_parts,
        HEAD_DIM=width,
        PARTS_BLOCK=min(32, triton.next_power_of_2(num_parts)),
        num_warps=4,
    )


@triton.jit
def _load_int4_tile_interleaved(
    cache_ptr,  # [num_slots * Hkv, HEAD_DIM // 2] uint8, element 2j low nibble of j
    scale_ptr,  # [num_slots * Hkv] float16 scales
    row,  # [BLOCK_N] int64 row (slot * Hkv + kv_head) of each token
    mask,  # [BLOCK_N] tokens inside the context
    HEAD_DIM: tl.constexpr,
    GAUSS: tl.constexpr,  # int4c's Gaussian levels
):
    even, odd = _load_int4_tile(cache_ptr, scale_ptr, row, mask, HEAD_DIM, GAUSS)
    # [BLOCK_N, D/2, 2] -> [BLOCK_N, D]: row-major merge puts even_j at 2j.
    return tl.reshape(tl.join(even, odd), [row.shape[0], HEAD_DIM])


@triton.jit
def _load_full_tile(
    window_ptr,  # [num_windows * WINDOW * Hkv, HEAD_DIM] bfloat16 ring of K or V
    ring,  # [BLOCK_N] int64 ring row of each token
    old,  # [BLOCK_N] tokens read from the ring (before the chunk)
    new_ptr,  # the chunk's own K or V of this kv head, head_dim contiguous
    new_offset,  # [BLOCK_N] int64 offset of each token's vector from new_ptr
    own,  # [BLOCK_N] tokens of the chunk itself
    HEAD_DIM: tl.constexpr,
):
    """A K or V tile in full precision: the ring's before the chunk, the chunk's own
    rounded to bf16 as the ring will hold them (float32, 0 elsewhere)."""
    full = _load_window_tile(window_ptr, ring, old, HEAD_DIM)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = new_ptr + new_offset[:, None] + offs_d[None, :]
    x = tl.load(ptrs, mask=own[:, None], other=0.0).to(tl.float32)
    x = fp32_to_bf16_rne(x).to(tl.float32)
    return tl.where(own[:, None], x, full)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM] queries of the new tokens, contiguous
    k_cache_ptr,  # key storage, [num_slots, Hkv, HEAD_DIM or HEAD_DIM//2]
    v_cache_ptr,  # value storage, same layout
    k_scale_ptr,  # [num_slots, Hkv] float16 key scales (dummy: unscaled)
    v_scale_ptr,  # [num_slots, Hkv] float16 value scales (dummy: unscaled)
    block_tables_ptr,  # [B, max_blocks] int32 physical block of each logical block
    query_start_loc_ptr,  # [B + 1] int32 first query row of each sequence
    context_lens_ptr,  # [B] int32 tokens in the cache per sequence, new ones included
    window_rows_ptr,  # [B] int32 window row of each sequence (dummy: WINDOW == 0)
    k_window_ptr,  # [num_windows * WINDOW, Hkv, HEAD_DIM] bfloat16 keys (dummy)
    v_window_ptr,  # [num_windows * WINDOW, Hkv, HEAD_DIM] bfloat16 values (dummy)
    k_new_ptr,  # [T, Hkv, HEAD_DIM] the chunks' own keys, full precision (dummy)
    v_new_ptr,  # [T, Hkv, HEAD_DIM] the chunks' own values (dummy: WINDOW == 0)
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    tile_seq_ptr,  # [num_tiles] int32 sequence of each query tile, -1 = no tile
    tile_start_ptr,  # [num_tiles] int32 first new-token index of the tile in its seq
    out_ptr,  # [T, num_heads, HEAD_DIM] output (query dtype)
    q_model_ptr,  # [T, num_heads, HEAD_DIM] float32 queries unrotated (int4c; dummy)
    key_mean_ptr,  # [Hkv, HEAD_DIM] float32 key means (int4c; dummy)
    inv_freq_ptr,  # [HEAD_DIM // 2] float32 RoPE inverse frequencies (int4c; dummy)
    softmax_scale,
    num_kv_heads,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,  # full-precision window length; 0 = none
    STATIC_SCALES: tl.constexpr,  # one scale per kv head (fp8)
    ROPE_DTYPE: tl.constexpr,  # int4c: ROPE_DTYPE_CODES of the model's dtype
):
    CENTERED: tl.constexpr = KV_DTYPE == 4  # int4c (module docstring)
    RING: tl.constexpr = WINDOW - CENTERED
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq >= 0:
        num_heads = num_kv_heads * GROUP
        kv_head = head // GROUP
        q_lo = tl.load(query_start_loc_ptr + seq)
        num_new = tl.load(query_start_loc_ptr + seq + 1) - q_lo
        context_len = tl.load(context_lens_ptr + seq)
        offs_m = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
        m_mask = offs_m < num_new
        q_pos = context_len - num_new + offs_m  # [BLOCK_M] positions in the sequence
        offs_d = tl.arange(0, HEAD_DIM)
        q_rows = (q_lo + offs_m).to(tl.int64) * num_heads + head
        q_ptrs = q_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
        q = q * softmax_scale
        if CENTERED:
            # the queries in the model's basis, as halves (RoPE pairs j, j + D/2)
            offs_j = tl.arange(0, HEAD_DIM // 2)
            qm_ptrs = q_model_ptr + q_rows[:, None] * HEAD_DIM + offs_j[None, :]
            qm_lo = tl.load(qm_ptrs, mask=m_mask[:, None], other=0.0) * softmax_scale
            qm_hi = tl.load(qm_ptrs + HEAD_DIM // 2, mask=m_mask[:, None], other=0.0)
            qm_hi = qm_hi * softmax_scale

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # Keys up to the tile's last position; position 0 is in the first K tile,
        # so every row has a finite max after it (no NaN from fully masked rows).
        end = tl.minimum(tl.max(q_pos, axis=0) + 1, context_len)
        if WINDOW > 0:
            window_row = tl.load(window_rows_ptr + seq).to(tl.int64)
            chunk_start = context_len - num_new
        for tok0 in range(0, end, BLOCK_N):
            offs_n = tok0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            block = tl.load(
                block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE,
                mask=n_mask,
                other=0,
            ).to(tl.int64)
            row = (block * BLOCK_SIZE + offs_n % BLOCK_SIZE) * num_kv_heads + kv_head
            scale_row = row * 0 + kv_head if STATIC_SCALES else row
            if KV_DTYPE == 3 or CENTERED:
                k = _load_int4_tile_interleaved(
                    k_cache_ptr, k_scale_ptr, row, n_mask, HEAD_DIM, CENTERED
                )
            else:
                k = _load_kv_tile(
                    k_cache_ptr, k_scale_ptr, row, scale_row, n_mask, HEAD_DIM, KV_DTYPE
                )
            # [BLOCK_M, BLOCK_N]
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if CENTERED:
                scores += _key_mean_scores(
                    qm_lo, qm_hi, key_mean_ptr, inv_freq_ptr, kv_head, offs_n,
                    HEAD_DIM, ROPE_DTYPE,
                )  # fmt: skip
            if WINDOW > 0:
                # Per query: keys p - RING < j <= p (and int4c's 0) in full
                # precision, from the window row before the chunk and from the
                # chunk's own K after.
                old = n_mask & (offs_n >= chunk_start - RING) & (offs_n < chunk_start)
                if CENTERED:
                    old = old | (n_mask & (offs_n == 0))  # own wins at chunk 0
                own = n_mask & (offs_n >= chunk_start)
                ring = _window_ring_row(
                    window_row, offs_n, num_kv_heads, kv_head, WINDOW, CENTERED
                )
                new_row = (q_lo + offs_n - chunk_start).to(tl.int64)
                k_full = _load_full_tile(
                    k_window_ptr, ring, old, k_new_ptr + kv_head * stride_knh,
                    new_row * stride_knt, own, HEAD_DIM,
                )  # fmt: skip
                recent = (q_pos[:, None] - offs_n[None, :]) < RING
                if CENTERED:
                    recent = recent | (offs_n[None, :] == 0)
                scores_full = tl.dot(q, tl.trans(k_full), input_precision=DOT_PRECISION)
                scores = tl.where(recent, scores_full, scores)
            causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            scores = tl.where(causal, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if KV_DTYPE == 3 or CENTERED:
                v = _load_int4_tile_interleaved(
                    v_cache_ptr, v_scale_ptr, row, n_mask, HEAD_DIM, CENTERED
                )
            else:
                v = _load_kv_tile(
                    v_cache_ptr, v_scale_ptr, row, scale_row, n_mask, HEAD_DIM, KV_DTYPE
                )
            acc = acc * alpha[:, None]
            if WINDOW > 0:
                v_full = _load_full_tile(
                    v_window_ptr, ring, old, v_new_ptr + kv_head * stride_vnh,
                    new_row * stride_vnt, own, HEAD_DIM,
                )  # fmt: skip
                acc += tl.dot(
                    tl.where(recent, p, 0.0), v_full, input_precision=DOT_PRECISION
                )
                p = tl.where(recent, 0.0, p)
            acc += tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def _paged_prefill_triton(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    window_rows: torch.Tensor | None = None,
    key_new: torch.Tensor | None = None,
    value_new: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.dtype] | None = None,
    block_m: int = PREFILL_BLOCK_M,
    block_n: int = PREFILL_BLOCK_N,
) -> torch.Tensor:
    check(query.is_contiguous(), "query must be contiguous [T, num_heads, head_dim]")
    check(
        cache.key.is_contiguous() and cache.value.is_contiguous(),
        "cache storage must be contiguous",
    )
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("context_lens", context_lens),
    ):
        check(t.dtype == torch.int32, f"{name} must be int32")
    check(block_tables.stride(-1) == 1, "block_tables rows must be contiguous")
    head_dim = cache.head_dim
    check(
        head_dim >= 16 and head_dim & (head_dim - 1) == 0,
        f"Triton paged attention needs a power-of-two head_dim >= 16, got {head_dim}",
    )
    num_tokens, num_heads, _ = query.shape
    batch = context_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    # Query tiles of block_m new tokens, never straddling two sequences. Their count
    # is at most T / block_m + B, so the grid is sized without a host sync and
    # the spare programs find tile_seq = -1 and exit.
    qsl = query_start_loc.long()
    num_new = qsl[1:] - qsl[:-1]  # [B]
    tiles_per_seq = (num_new + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles_per_seq, 0)  # [B] one past each seq's last tile
    num_tiles = num_tokens // block_m + batch
    ids = torch.arange(num_tiles, device=query.device)
    seq = torch.searchsorted(tiles_end, ids, right=True)  # [num_tiles]
    seq_c = seq.clamp(max=batch - 1)
    start = (ids - tiles_end[seq_c] + tiles_per_seq[seq_c]) * block_m
    tile_seq = torch.where(seq < batch, seq, -1).to(torch.int32)
    key, value = cache.key, cache.value
    if cache.stores_fp8:
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    key_scale = cache.key_scale if cache.key_scale is not None else key
    value_scale = cache.value_scale if cache.value_scale is not None else value
    rows, window_key, window_value = window_kernel_args(
        cache, window_rows, context_lens, "window_rows"
    )
    if cache.window:
        check(
            key_new.stride(-1) == 1 and value_new.stride(-1) == 1,
            "key/value must be contiguous in head_dim",
        )
    else:
        key_new = value_new = query
    *mean_args, rope_code = _centered_args(query, cache, rope)
    _paged_prefill_kernel[(num_tiles, num_heads)](
        query,
        key,
        value,
        key_scale,
        value_scale,
        block_tables,
        query_start_loc,
        context_lens,
        rows,
        window_key,
        window_value,
        key_new,
        value_new,
        key_new.stride(0),
        key_new.stride(1),
        value_new.stride(0),
        value_new.stride(1),
        tile_seq,
        start.to(torch.int32),
        out,
        *mean_args,
        softmax_scale,
        cache.num_kv_heads,
        block_tables.stride(0),
        GROUP=num_heads // cache.num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=cache.block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        KV_DTYPE=KV_DTYPE_CODES[cache.dtype],
        DOT_PRECISION=_dot_precision(cache),
        WINDOW=cache.window,
        STATIC_SCALES=cache.static_scales,
        ROPE_DTYPE=rope_code,
        num_warps=4 if head_dim <= 64 else 8,
    )
    return out


# --------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------


def _check_attention_args(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    window_rows: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.dtype] | None,
) -> None:
    if cache.dtype in CENTERED_DTYPES:
        check(cache.means_set, f"an {cache.dtype} cache needs its key means set")
        check(
            rope is not None
            and tuple(rope[0].shape) == (cache.head_dim // 2,)
            and rope[1] in ROPE_DTYPE_CODES,
            f"{cache.dtype} attention needs rope=(inverse frequencies "
            f"[{cache.head_dim // 2}], the model's float dtype)",
        )
    else:
        check(rope is None, f"rope is for int4c's key means, not {cache.dtype}")
    check(
        query.dim() == 3, f"query must be [*, num_heads, head_dim], got {query.shape}"
    )
    check(
        query.shape[2] == cache.head_dim,
        f"query head_dim {query.shape[2]} != cache head_dim {cache.head_dim}",
    )
    check(
        query.shape[1] % cache.num_kv_heads == 0,
        f"num_heads {query.shape[1]} is not a multiple of {cache.num_kv_heads}",
    )
    check(
        query.dtype in (torch.bfloat16, torch.float16, torch.float32),
        f"query must be bf16/fp16/fp32, got {query.dtype}",
    )
    check(block_tables.dim() == 2, "block_tables must be [B, max_blocks]")
    if cache.window:
        check(
            window_rows is not None
            and window_rows.shape == (block_tables.shape[0],)
            and window_rows.dtype == torch.int32,
            "a cache with a window needs window_rows [B] int32",
        )
    else:
        check(window_rows is None, "window_rows given but the cache has no window")


def paged_decode_attention(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    window_rows: torch.Tensor | None = None,
    impl: str = "auto",
    rope: tuple[torch.Tensor, torch.dtype] | None = None,
) -> torch.Tensor:
    """Decode attention: query [B, num_heads, D] -> [B, num_heads, D] (query dtype).

    block_tables [B, max_blocks] int32, context_lens [B] int32 (tokens in the cache,
    the new token's K/V already written); window_rows [B] int32, each sequence's
    window row, when the cache has a window. An int4c cache also needs `rope`:
    the model's RoPE inverse frequencies [D/2] and the dtype it RoPEs keys in (its
    key means' offsets). Triton on CUDA, torch reference elsewhere (none for
    int4c: `gpuagent.engine.kv_int4c` is its torch path).
    """
    _check_attention_args(query, cache, block_tables, window_rows, rope)
    check(
        block_tables.shape[0] == query.shape[0] == context_lens.shape[0],
        "query, block_tables and context_lens disagree on the batch size",
    )
    windowed = (window_rows, cache.window_key) if cache.window else ()
    if use_triton(impl, query, cache.key, block_tables, context_lens, *windowed):
        return _paged_decode_triton(
            query, cache, block_tables, context_lens, softmax_scale, window_rows, rope
        )
    refuse_centered(cache.dtype, "paged attention's torch reference")
    return paged_decode_attention_reference(
        query, cache, block_tables, context_lens, softmax_scale, window_rows
    )


def paged_prefill_attention(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    window_rows: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    impl: str = "auto",
    rope: tuple[torch.Tensor, torch.dtype] | None = None,
) -> torch.Tensor:
    """Chunked-prefill attention: query [T, num_heads, D] -> [T, num_heads, D].

    Sequence b owns query[qsl[b]:qsl[b+1]]; context_lens[b] counts its cached tokens
    including the new ones (already written to the blocks). New token i sits at
    position p = context_lens[b] - n_new + i and attends causally to positions <= p.
    With a window, it reads positions p - window + 1 .. p in full precision: the
    chunk's own from `key`/`value` [T, Hkv, D] (the new K/V as written, required
    then), the older ones from the window row, which must not hold the chunk yet
    (`kv_quant.write_window` after this call). int4c: `rope` as for
    `paged_decode_attention`, and its window row is written after this call too.
    """
    _check_attention_args(query, cache, block_tables, window_rows, rope)
    if cache.window:
        expected = (query.shape[0], cache.num_kv_heads, cache.head_dim)
        check(
            key is not None
            and value is not None
            and tuple(key.shape) == expected
            and tuple(value.shape) == expected,
            f"a cache with a window needs the chunk's key/value {list(expected)}",
        )
    check(
        query_start_loc.shape[0]
        == block_tables.shape[0] + 1
        == context_lens.shape[0] + 1,
        "query_start_loc must be [B+1] and context_lens [B]",
    )
    windowed = (window_rows, cache.window_key, key, value) if cache.window else ()
    if not use_triton(impl, query, cache.key, block_tables, context_lens, *windowed):
        refuse_centered(cache.dtype, "paged attention's torch reference")
        return paged_prefill_attention_reference(
            query,
            cache,
            block_tables,
            query_start_loc,
            context_lens,
            softmax_scale,
            window_rows,
            key,
            value,
        )
    return _paged_prefill_triton(
        query.contiguous(),
        cache,
        block_tables,
        query_start_loc,
        context_lens,
        softmax_scale,
        window_rows,
        key,
        value,
        rope,
    )
