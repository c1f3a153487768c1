"""The "int4c" KV layout (issue 33 item 4): the served int4's bytes, keys stored
centered on their layer's RoPE'd key mean, Gaussian int4 levels, and the first
position kept in bf16 beside the window. What `gpuagent.benches.kv_alternatives`
simulated as sim-int4gc+w17s1 (its math is this module's and `kernels.kv_gauss`'s).

- Calibration (`key_means`, at engine start like fp8's static scales): per layer
  the mean [KVH, D] float32 of the keys *before RoPE* over the engine's
  calibration text (`kv_calibration.CALIBRATION_TEXTS`), each sequence's first
  position left out. Stored in the cache (`PagedKVCache.key_mean`, counted in its
  bytes like fp8's scales) and part of the prefix cache's root.
- Write: K and V rotated (Hadamard, float32) as int4 does; a key at position p >= 1
  is stored less m_p = RoPE_p(mean) (rotated too), position 0 as it is. Both go
  through `kernels.kv_gauss.quantize_gauss` into the int4 blocks (D/2 code bytes and
  a float16 scale per head vector).
- Read: `dequantize_gauss`, plus m_p for keys: exact but for the quantization error.
- Full precision: a window row of W slots holds the newest W - 1 tokens (ring slot
  p % (W - 1)) and, in its last slot, position 0 (the attention sink). The query at
  position t reads positions p >= t + 2 - W and p = 0 from it (or from the step's
  own K/V), older ones quantized: the bytes of int4 with a W-token window. The
  engine's default W is 18 (sim-int4gc+w17s1).
- Prefix cache: only position 0's own forward writes the sink slot, so a cached
  first block keeps a copy of it (its sink, `engine.cache`), which a hit copies
  into its row's last slot; the hit then recomputes layers * (W - 2) positions
  before its first uncached one, not the prefix (`cache.window_refill_tokens`).

The writer is torch code (below) on every device. On CUDA the paged attention
kernels read the cache (`kernels.paged_attention`: Gaussian levels, the mean term
q . RoPE_p(mean), the window row with its sink slot); elsewhere the torch
attention below, their reference, does. It gathers each sequence's whole context
per step and is meant for measurement and tests, not for speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

import kernels
from gpuagent.engine.model import Attention, apply_rope, rope_cos_sin
from kernels._triton import use_triton
from kernels.kv_gauss import dequantize_gauss, quantize_gauss

if TYPE_CHECKING:
    from gpuagent.engine.model import AttentionMetadata

DTYPE = "int4c"


def key_means(model, sequences: Sequence[list[int]]) -> list[Tensor]:
    """Per layer, the mean [KVH, D] float32 of the keys before RoPE over
    `sequences` (each run through the model's dense forward, its first position
    left out: an attention sink's key is no typical key)."""
    for layer in model.layers:  # k_proj's output is the key before RoPE
        if type(layer.self_attn) is not Attention:
            raise ValueError(
                f"{DTYPE} KV is for Llama attention (the key k_proj(x), RoPE'd over "
                f"the whole head); {type(layer.self_attn).__name__} differs"
            )
    config = model.config
    device = next(model.parameters()).device
    kv_heads, dim = config.num_key_value_heads, config.head_dim
    sums = [torch.zeros(kv_heads, dim, device=device) for _ in model.layers]
    count = 0
    with torch.inference_mode():
        for ids in sequences:
            if len(ids) < 2:
                continue
            cos, sin = model._rope(torch.arange(len(ids), device=device))
            h = model.embed_tokens(torch.tensor(ids, device=device))[None]
            for total, layer in zip(sums, model.layers, strict=True):
                x = layer.input_layernorm(h)
                key = layer.self_attn.k_proj(x).unflatten(-1, (kv_heads, dim))
                total += key[0, 1:].float().sum(0)
                h = layer.forward_dense(h, cos, sin)
            count += len(ids) - 1
    if count == 0:
        raise ValueError("int4c's key means need a calibration sequence of 2+ tokens")
    return [total / count for total in sums]


def set_key_means(caches: Sequence[kernels.PagedKVCache], means: list[Tensor]) -> None:
    """Give each layer's int4c cache its key mean ([KVH, D], finite)."""
    if len(caches) != len(means):
        raise ValueError(f"{len(caches)} caches but {len(means)} key means")
    for cache, mean in zip(caches, means, strict=True):
        if cache.dtype != DTYPE:
            raise ValueError(f"key means are for {DTYPE} caches, not {cache.dtype}")
        shape = (cache.num_kv_heads, cache.head_dim)
        if tuple(mean.shape) != shape or not bool(torch.isfinite(mean).all()):
            raise ValueError(f"a key mean must be finite {list(shape)}")
        cache.key_mean.copy_(mean)
        cache.means_set = True


def key_offsets(
    cache: kernels.PagedKVCache,
    positions: Tensor,
    inv_freq: Tensor,
    dtype: torch.dtype,
    rotation: Tensor,
) -> Tensor:
    """m_p [N, KVH, D] float32 for positions [N]: the layer's key mean in the
    model's `dtype`, RoPE'd to p, rotated (float32 `rotation`); zero at p = 0."""
    n = positions.shape[0]
    mean = cache.key_mean.to(dtype).expand(n, cache.num_kv_heads, cache.head_dim)
    cos, sin = rope_cos_sin(inv_freq.to(positions.device), positions)
    offset = apply_rope(mean, cos.to(dtype), sin.to(dtype)).float()
    offset = offset.masked_fill((positions == 0)[:, None, None], 0.0)
    return offset @ rotation


def _write_blocks(
    cache: kernels.PagedKVCache, key: Tensor, value: Tensor, slots: Tensor
) -> None:
    # key (centered) / value [T, KVH, D] float32 into the int4 blocks; slot -1 skips
    keep = slots >= 0
    key, value, slots = key[keep], value[keep], slots[keep]
    for src, store, scale in (
        (key, cache.key, cache.key_scale),
        (value, cache.value, cache.value_scale),
    ):
        codes, s = quantize_gauss(src)
        store.view(cache.num_slots, cache.num_kv_heads, -1).index_copy_(0, slots, codes)
        scale.view(cache.num_slots, cache.num_kv_heads).index_copy_(0, slots, s)


def _write_full_precision(
    cache: kernels.PagedKVCache,
    key: Tensor,
    value: Tensor,
    positions: Tensor,
    rows: Tensor,
    ends: Tensor,
) -> None:
    # each token's bf16 copy into its row: the ring when among the newest W - 1
    # of its sequence after this step (position < ends), the sink slot at p = 0
    ring = cache.window - 1
    newest = positions >= ends - ring
    sink = positions == 0
    for store, src in ((cache.window_key, key), (cache.window_value, value)):
        src = src.to(store.dtype)
        store[rows[newest], positions[newest] % ring] = src[newest]
        store[rows[sink], ring] = src[sink]


def _sequence_attention(
    cache: kernels.PagedKVCache,
    query: Tensor,  # [n, H, D] float32, the wanted queries of one sequence
    query_pos: Tensor,  # [n]
    key: Tensor,  # [c, KVH, D] float32, the step's own K of this sequence
    value: Tensor,
    start: int,  # position of the step's first token
    context_len: int,
    block_table: Tensor,
    row: int,
    inv_freq: Tensor,
    dtype: torch.dtype,
    rotation: Tensor,
    softmax_scale: float,
) -> Tensor:
    kv_heads, ring = cache.num_kv_heads, cache.window - 1
    pos = torch.arange(context_len, device=query.device)
    table = block_table.long()
    slots = table[pos // cache.block_size] * cache.block_size + pos % cache.block_size
    read = []
    stores = ((cache.key, cache.key_scale), (cache.value, cache.value_scale))
    for store, scale in stores:
        codes = store.view(cache.num_slots, kv_heads, -1)[slots]
        read.append(dequantize_gauss(codes, scale.view(cache.num_slots, -1)[slots]))
    quant_key = read[0] + key_offsets(cache, pos, inv_freq, dtype, rotation)
    quant_value = read[1]
    # full-precision copies: the row as before this step, then the step's own
    full_key = torch.zeros_like(quant_key)
    full_value = torch.zeros_like(quant_value)
    before = pos[max(0, start - ring) : start]
    full_key[before] = cache.window_key[row, before % ring].float()
    full_value[before] = cache.window_value[row, before % ring].float()
    if start > 0:
        full_key[0] = cache.window_key[row, ring].float()
        full_value[0] = cache.window_value[row, ring].float()
    full_key[start:] = key.to(torch.bfloat16).float()
    full_value[start:] = value.to(torch.bfloat16).float()
    # [n, c]: which positions each query reads in bf16, and which it sees at all
    exact = (pos[None, :] >= query_pos[:, None] + 1 - ring) | (pos[None, :] == 0)
    causal = pos[None, :] <= query_pos[:, None]
    groups = query.shape[1] // kv_heads
    q = query.unflatten(1, (kv_heads, groups))  # [n, KVH, G, D]
    scores = torch.where(
        exact[None, None],
        torch.einsum("tkgd,pkd->kgtp", q, full_key),
        torch.einsum("tkgd,pkd->kgtp", q, quant_key),
    )
    scores = (scores * softmax_scale).masked_fill(~causal, -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgtp,pkd->tkgd", probs * ~exact, quant_value)
    out += torch.einsum("kgtp,pkd->tkgd", probs * exact, full_value)
    return out.flatten(1, 2)  # [n, H, D]


def attention(
    query: Tensor,  # [T, H, D], RoPE'd, model dtype
    key: Tensor,  # [T, KVH, D]
    value: Tensor,
    cache: kernels.PagedKVCache,
    attn: AttentionMetadata,
    softmax_scale: float,
    out_rows: Tensor | None,
    impl: str = "auto",
) -> Tensor:
    """Write the step's K/V into the int4c `cache` and attend: [T, H, D] float32
    in the unrotated basis, or [B, H, D] for the rows `out_rows` (or every row of
    a decode step). `attn` carries the step's positions and the RoPE inverse
    frequencies (`Transformer.forward` sets them for int4c). `impl`: "auto" (the
    kernels on CUDA, the torch attention elsewhere), "triton" or "reference"."""
    if not cache.means_set:
        raise ValueError("an int4c cache needs its key means before the first write")
    if attn.positions is None or attn.rope_inv_freq is None:
        raise ValueError("int4c attention needs the step's positions and RoPE")
    dtype = query.dtype
    rotation = kernels.hadamard(cache.head_dim, query.device)  # [D, D], symmetric
    q, k, v = (x.float() @ rotation for x in (query, key, value))
    positions = attn.positions.long()
    offsets = key_offsets(cache, positions, attn.rope_inv_freq, dtype, rotation)
    _write_blocks(cache, k - offsets, v, attn.slot_mapping.long())
    if use_triton(impl, q, cache.key, attn.block_tables, attn.context_lens):
        out = _kernel_attention(q, k, v, cache, attn, softmax_scale, out_rows, dtype)
    else:
        out = _torch_attention(
            q, k, v, cache, attn, softmax_scale, out_rows, dtype, rotation, positions
        )
    return out @ rotation.T  # [T or B, H, D] back from the rotated basis


def _full_precision_rows(
    attn: AttentionMetadata, positions: Tensor
) -> tuple[Tensor, Tensor]:
    # (window row, context length after the step) [T] of each new token
    seq = torch.repeat_interleave(
        torch.arange(attn.context_lens.shape[0], device=positions.device),
        attn.query_start_loc.diff().long(),
    )
    return attn.window_rows.long()[seq], attn.context_lens.long()[seq]


def _kernel_attention(
    q: Tensor,  # [T, H, D] float32, rotated
    k: Tensor,  # [T, KVH, D] float32, rotated
    v: Tensor,
    cache: kernels.PagedKVCache,
    attn: AttentionMetadata,
    softmax_scale: float,
    out_rows: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    # The blocks hold the step already. Decode reads the window row with the
    # step in it (written first); prefill reads it as before its chunk, the
    # chunk's own K/V from k, v (written after), as int4's kernels do.
    rows, ends = _full_precision_rows(attn, attn.positions.long())
    rope = (attn.rope_inv_freq, dtype)
    if out_rows is not None or attn.decode_only:
        _write_full_precision(cache, k, v, attn.positions.long(), rows, ends)
        return kernels.paged_decode_attention(
            q if out_rows is None else q[out_rows.long()],
            cache,
            attn.block_tables,
            attn.context_lens,
            softmax_scale,
            attn.window_rows,
            impl="triton",
            rope=rope,
        )
    out = kernels.paged_prefill_attention(
        q,
        cache,
        attn.block_tables,
        attn.query_start_loc,
        attn.context_lens,
        softmax_scale,
        attn.window_rows,
        k,
        v,
        impl="triton",
        rope=rope,
    )
    _write_full_precision(cache, k, v, attn.positions.long(), rows, ends)
    return out


def _torch_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: kernels.PagedKVCache,
    attn: AttentionMetadata,
    softmax_scale: float,
    out_rows: Tensor | None,
    dtype: torch.dtype,
    rotation: Tensor,
    positions: Tensor,
) -> Tensor:
    qsl = attn.query_start_loc.long().tolist()
    ctx = attn.context_lens.long().tolist()
    window_rows = attn.window_rows.long()
    wanted = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    wanted[slice(None) if out_rows is None else out_rows.long()] = True
    out = torch.zeros_like(q)
    for b in range(len(ctx)):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        take = torch.nonzero(wanted[lo:hi]).flatten() + lo
        if take.numel() == 0:
            continue
        out[take] = _sequence_attention(
            cache,
            q[take],
            positions[take],
            k[lo:hi],
            v[lo:hi],
            ctx[b] - (hi - lo),
            ctx[b],
            attn.block_tables[b],
            int(window_rows[b]),
            attn.rope_inv_freq,
            dtype,
            rotation,
            softmax_scale,
        )
    rows, ends = _full_precision_rows(attn, positions)
    _write_full_precision(cache, k, v, positions, rows, ends)
    if out_rows is not None:
        return out[out_rows.long()]
    return out
