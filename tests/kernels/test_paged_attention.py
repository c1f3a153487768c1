"""kernels.paged_attention: decode and prefill over a paged, quantized KV cache.

The reference is checked against a slow loop over tokens that never touches the
paging (it attends over the round-tripped K/V it wrote); the Triton kernel is checked
against the reference on irregular shapes and shuffled physical blocks.
"""

import math

import pytest
import torch

import kernels
from kernels import paged_attention
from kernels.paged_attention import paged_decode_attention_reference
from tests.kernels.compile_helper import compile_for_sm90

# fp8 (one calibrated scale per head) has its own tests: test_kv_static.py; int4c
# (written by the engine's torch code, which is also its attention reference)
# tests/gpuagent/engine/test_kv_int4c_kernels.py
PER_TOKEN_DTYPES = [
    d
    for d in kernels.KV_CACHE_DTYPES
    if d not in (*kernels.STATIC_SCALE_DTYPES, *kernels.CENTERED_DTYPES)
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (atol, rtol) of Triton vs reference, per KV dtype. Both dequantize to the same
# float32 values, so the tolerance only covers summation order (interpreter, fp32
# dots) or TF32 dots (CUDA; the fp32 cache asks for IEEE float32 dots instead).
TOLERANCE = {
    "cpu": {d: (2e-5, 2e-5) for d in kernels.KV_CACHE_DTYPES},
    "cuda": {"bf16": (5e-3, 5e-3), "fp16": (5e-3, 5e-3), "fp8-per-token": (5e-3, 5e-3),
             "int8": (5e-3, 5e-3), "int4": (5e-3, 5e-3), "fp32": (1e-4, 1e-4)},
}  # fmt: skip

# (num_heads, num_kv_heads, head_dim, block_size): GQA ratios 1, 4, 8.
SHAPES = [(2, 2, 64, 16), (8, 2, 128, 32), (8, 1, 64, 16)]


def filled_cache(dtype, shape, context_lens, seed=0, device="cpu", offset=None):
    """A cache holding random K/V for each sequence in shuffled physical blocks.

    Returns (cache, block_tables, context_lens, per-sequence (key, value) written).
    """
    _, num_kv_heads, head_dim, block_size = shape
    chunks = [[c] for c in context_lens]  # each sequence written at once
    cache, tables, lens, _, written = _fill_cache(
        dtype, (num_kv_heads, head_dim, block_size, 0), chunks, seed, device, offset
    )
    return cache, tables, lens, written


def _fill_cache(dtype, layout, chunks, seed, device, offset=None, prefill=False):
    """The cache behind filled_cache and windowed_cache. layout is (num_kv_heads,
    head_dim, block_size, window); sequence b writes chunks[b] tokens at a time
    (with `prefill`, the last chunk to the blocks only: its window is written after
    prefill attention, as the model does).
    Returns (cache, block_tables, context_lens, window_rows or None, written)."""
    num_kv_heads, head_dim, block_size, window = layout
    g = torch.Generator().manual_seed(seed)
    context_lens = [sum(c) for c in chunks]
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    num_windows = len(chunks) + 2 if window else 0
    cache = kernels.allocate_kv_cache(
        dtype, num_blocks, block_size, num_kv_heads, head_dim, device=device,
        window=window, num_windows=num_windows,
    )  # fmt: skip
    pool = torch.randperm(num_blocks, generator=g).tolist()
    rows = None
    if window:  # shuffled, with spare rows
        rows = torch.randperm(num_windows, generator=g)[: len(chunks)]
    width = max(max(blocks_per_seq), 1)
    tables = torch.full((len(chunks), width), -1, dtype=torch.int32)
    written = []
    for b, ctx in enumerate(context_lens):
        mine = [pool.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        key = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        value = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        if offset is not None:
            key, value = key + offset[0], value + offset[1]
        start = 0
        for i, n in enumerate(chunks[b]):
            pos = torch.arange(start, start + n)
            slots = torch.tensor(mine, dtype=torch.int64)[pos // block_size]
            slots = slots * block_size + pos % block_size
            ring = None
            if prefill and i == len(chunks[b]) - 1:
                kernels.write_kv(
                    cache, key[pos].to(device), value[pos].to(device),
                    slots.to(device), blocks_only=True,
                )  # fmt: skip
                start += n
                continue
            if window:
                ring = int(rows[b]) * window + pos % window
                ring = torch.where(pos >= start + n - window, ring, -1).to(device)
            kernels.write_kv(
                cache, key[pos].to(device), value[pos].to(device),
                slots.to(device), ring,
            )  # fmt: skip
            start += n
        written.append((key, value))
    lens = torch.tensor(context_lens, dtype=torch.int32).to(device)
    rows = None if rows is None else rows.to(torch.int32).to(device)
    return cache, tables.to(device), lens, rows, written


def slow_attention_one(q, key, value, positions_allowed, scale):
    """softmax(q . k_t * scale) . v_t over t < positions_allowed, token by token."""
    scores = [float(q @ key[t]) * scale for t in range(positions_allowed)]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    out = sum(w * value[t].double() for t, w in enumerate(weights))
    return out / sum(weights)


def assert_chunk_matches_slow(out, query, first, new, context, key, value, scale):
    """Prefill rows first..first+new-1 of `out` (a chunk ending at `context`) equal
    the slow loop, head by head, over K/V [context, Hkv, D] as the kernel must see
    them."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    for i in range(new):
        token, position = first + i, context - new + i
        for h in range(num_heads):
            kvh = h // (num_heads // num_kv_heads)
            want = slow_attention_one(
                query[token, h].double(), key[:, kvh], value[:, kvh],
                position + 1, scale,
            )  # fmt: skip
            torch.testing.assert_close(
                out[token, h].double(), want, atol=1e-5, rtol=1e-5
            )


def slow_decode(query, written, dtype, scale):
    batch, num_heads, _ = query.shape
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b in range(batch):
        key, value = written[b]
        num_kv_heads = key.shape[1]
        key = kernels.dequantize_kv(*kernels.quantize_kv(key, dtype), dtype).double()
        value = kernels.dequantize_kv(*kernels.quantize_kv(value, dtype), dtype)
        for h in range(num_heads):
            kvh = h // (num_heads // num_kv_heads)
            q = query[b, h].double()
            out[b, h] = slow_attention_one(
                q, key[:, kvh], value[:, kvh], key.shape[0], scale
            )
    return out


def decode_context_lens(block_size):
    # Odd batch; context 1, bs-1, bs+1, exactly one block, many blocks.
    return [1, block_size - 1, block_size + 1, block_size, 4 * block_size + 3]


@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_it_decodes_like_a_slow_loop_over_tokens(dtype, shape):
    num_heads, _, head_dim, block_size = shape
    lens = decode_context_lens(block_size)
    cache, tables, ctx, written = filled_cache(dtype, shape, lens)
    query = torch.randn(len(lens), num_heads, head_dim)

    out = kernels.paged_decode_attention(
        query, cache, tables, ctx, head_dim**-0.5, impl="reference"
    )

    want = slow_decode(query, written, dtype, head_dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_it_decodes_with_triton_like_the_reference(dtype, shape):
    num_heads, _, head_dim, block_size = shape
    lens = decode_context_lens(block_size)
    cache, tables, ctx, _ = filled_cache(dtype, shape, lens, seed=1)
    query = torch.randn(len(lens), num_heads, head_dim)

    got = kernels.paged_decode_attention(
        query, cache, tables, ctx, head_dim**-0.5, impl="triton"
    )

    want = paged_decode_attention_reference(query, cache, tables, ctx, head_dim**-0.5)
    atol, rtol = TOLERANCE["cpu"][dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_it_merges_context_partitions_including_empty_ones(dtype):
    # Small partitions: 67 tokens span 5 partitions of 16, the short sequences leave
    # most partitions empty, and a context of 0 must give 0 rather than NaN.
    shape = (4, 2, 64, 16)
    lens = [67, 1, 0, 33]
    cache, tables, ctx, _ = filled_cache(dtype, shape, lens, seed=2)
    query = torch.randn(4, 4, 64, dtype=torch.bfloat16)

    got = paged_attention._paged_decode_triton(
        query, cache, tables, ctx, 0.125, partition_size=16, block_n=16
    )

    want = paged_decode_attention_reference(query, cache, tables, ctx, 0.125)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    # bf16 output: one bf16 rounding step apart at most.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


PREFILL_SEQS = [(5, 5), (17, 3), (1, 1), (40, 7)]  # (context incl. new, new tokens)


def prefill_inputs(dtype, shape, seed):
    num_heads, _, head_dim, _ = shape
    lens = [c for c, _ in PREFILL_SEQS]
    cache, tables, ctx, written = filled_cache(dtype, shape, lens, seed=seed)
    qsl = torch.tensor([0] + [n for _, n in PREFILL_SEQS], dtype=torch.int32)
    qsl = qsl.cumsum(0).to(torch.int32)
    query = torch.randn(int(qsl[-1]), num_heads, head_dim)
    return query, cache, tables, qsl, ctx, written


@pytest.mark.parametrize("dtype", ["bf16", "fp8-per-token", "int4", "fp32"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]])
def test_it_prefills_causally_over_the_cached_prefix_like_a_slow_loop(dtype, shape):
    query, cache, tables, qsl, ctx, written = prefill_inputs(dtype, shape, seed=3)
    num_heads, num_kv_heads, head_dim, _ = shape
    scale = head_dim**-0.5

    out = kernels.paged_prefill_attention(
        query, cache, tables, qsl, ctx, scale, impl="reference"
    )

    for b, (context, new) in enumerate(PREFILL_SEQS):
        key, value = written[b]
        key = kernels.dequantize_kv(*kernels.quantize_kv(key, dtype), dtype).double()
        value = kernels.dequantize_kv(*kernels.quantize_kv(value, dtype), dtype)
        assert_chunk_matches_slow(
            out, query, int(qsl[b]), new, context, key, value, scale
        )


@pytest.mark.parametrize("dtype", ["fp16", "int8", "int4", "fp32"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]])
def test_it_prefills_with_triton_like_the_reference(dtype, shape):
    query, cache, tables, qsl, ctx, _ = prefill_inputs(dtype, shape, seed=4)
    scale = shape[2] ** -0.5

    got = kernels.paged_prefill_attention(
        query, cache, tables, qsl, ctx, scale, impl="triton"
    )

    want = kernels.paged_prefill_attention(
        query, cache, tables, qsl, ctx, scale, impl="reference"
    )
    atol, rtol = TOLERANCE["cpu"][dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_it_prefills_long_chunks_in_several_query_tiles(dtype):
    # 16-token query tiles: 37 new tokens take three tiles (the last one partial),
    # a sequence with no new tokens takes none, the grid has spare tiles.
    shape = (8, 2, 64, 16)
    seqs = [(50, 37), (20, 0), (16, 16)]
    cache, tables, ctx, _ = filled_cache(dtype, shape, [c for c, _ in seqs], seed=8)
    qsl = torch.tensor([0, 37, 37, 53], dtype=torch.int32)
    query = torch.randn(53, 8, 64)

    got = paged_attention._paged_prefill_triton(
        query, cache, tables, qsl, ctx, 0.125, block_m=16, block_n=16
    )

    want = kernels.paged_prefill_attention(
        query, cache, tables, qsl, ctx, 0.125, impl="reference"
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_it_rejects_mismatched_shapes():
    cache, tables, ctx, _ = filled_cache("int8", (4, 2, 64, 16), [3, 5])
    with pytest.raises(ValueError, match="multiple"):
        kernels.paged_decode_attention(torch.randn(2, 3, 64), cache, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_decode_attention(torch.randn(2, 4, 32), cache, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="batch"):
        kernels.paged_decode_attention(torch.randn(3, 4, 64), cache, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_decode_attention(
            torch.randn(2, 4, 64), cache, tables.long(), ctx, 1.0, impl="triton"
        )


# (num_heads, num_kv_heads, head_dim, block_size, window): GQA 1 with a window
# shorter than a block, GQA 4 with one that spans blocks.
WINDOW_SHAPES = [(2, 2, 64, 16, 8), (8, 2, 64, 8, 12)]


def windowed_cache(dtype, shape, chunks, seed=0, device="cpu", prefill=False):
    """A cache with a full-precision window, filled the way an engine does it:
    sequence b writes chunks[b] tokens at a time (e.g. [25, 5]: a prefill, then
    5 more), each write sending the tokens among the newest `window` positions
    after it to the window too. Block tables are shuffled, every sequence has its
    own window row (shuffled, with spare rows).

    Returns (cache, block_tables, context_lens, window_rows, per-seq (key, value)).
    """
    _, num_kv_heads, head_dim, block_size, window = shape
    return _fill_cache(
        dtype,
        (num_kv_heads, head_dim, block_size, window),
        chunks,
        seed,
        device,
        prefill=prefill,
    )


def slow_windowed_kv(src, dtype, window):
    """What a reader must see of one sequence's K or V [L, Hkv, D], position by
    position: the newest `window` in bf16, every older one round-tripped through
    `dtype` (float64)."""
    length = src.shape[0]
    out = torch.empty(src.shape, dtype=torch.float64)
    for p in range(length):
        if p >= length - window:
            out[p] = src[p].to(torch.bfloat16).double()
        else:
            stored, scale = kernels.quantize_kv(src[p], dtype)
            out[p] = kernels.dequantize_kv(stored, scale, dtype).double()
    return out


def window_decode_chunks(block_size, window):
    # Context 1, W-1, W, W+1, bs+1 and a longer one; each a prefill, then one token.
    lens = [1, window - 1, window, window + 1, block_size + 1, 3 * block_size + 5]
    return [[c] if c == 1 else [c - 1, 1] for c in lens]


# (context incl. new, new tokens) per step: a chunk shorter than the window after a
# prefill (part of the window from the earlier step), one prefill that fills the
# window exactly, one longer than it, a one-token prompt, a window that crosses a
# 32-token K/V tile.
WINDOW_PREFILL_CHUNKS = [[25, 5], [12], [1], [20], [37, 3]]


def window_prefill_inputs(dtype, shape, seed, chunks=None):
    """A windowed cache whose sequences' last chunks are written to the blocks
    only, queries for those chunks, and the chunks' own K/V (flat, [T, Hkv, D]) and
    window slots (the model writes them after prefill attention)."""
    chunks = chunks or WINDOW_PREFILL_CHUNKS
    num_heads, _, head_dim, _, window = shape
    cache, tables, ctx, rows, written = windowed_cache(
        dtype, shape, chunks, seed=seed, prefill=True
    )
    qsl = torch.tensor([0] + [c[-1] for c in chunks]).cumsum(0)
    query = torch.randn(int(qsl[-1]), num_heads, head_dim)
    keys, values, rings = [], [], []
    for b, (key, value) in enumerate(written):
        length, new = key.shape[0], chunks[b][-1]
        pos = torch.arange(length - new, length)
        keys.append(key[pos])
        values.append(value[pos])
        ring = int(rows[b]) * window + pos % window
        rings.append(torch.where(pos >= length - window, ring, -1))
    new_kv = torch.cat(keys), torch.cat(values), torch.cat(rings)
    return query, cache, tables, qsl.to(torch.int32), ctx, rows, written, new_kv


def slow_per_query_kv(src, dtype, window, position):
    """What the query at `position` must see of one sequence's K or V [L, Hkv, D]:
    positions position - window + 1 .. position in bf16, older ones round-tripped
    through `dtype` (float64), positions 0..position."""
    out = torch.empty((position + 1, *src.shape[1:]), dtype=torch.float64)
    for p in range(position + 1):
        if position - p < window:
            out[p] = src[p].to(torch.bfloat16).double()
        else:
            stored, scale = kernels.quantize_kv(src[p], dtype)
            out[p] = kernels.dequantize_kv(stored, scale, dtype).double()
    return out


@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8", "int4"])
def test_it_decodes_with_a_window_like_a_slow_loop(dtype):
    shape = WINDOW_SHAPES[1]
    num_heads, num_kv_heads, head_dim, block_size, window = shape
    chunks = window_decode_chunks(block_size, window)
    cache, tables, ctx, rows, written = windowed_cache(dtype, shape, chunks, seed=20)
    query = torch.randn(len(chunks), num_heads, head_dim)
    scale = head_dim**-0.5

    out = kernels.paged_decode_attention(
        query, cache, tables, ctx, scale, rows, impl="reference"
    )

    for b, (key, value) in enumerate(written):
        key = slow_windowed_kv(key, dtype, window)
        value = slow_windowed_kv(value, dtype, window)
        for h in range(num_heads):
            kvh = h // (num_heads // num_kv_heads)
            want = slow_attention_one(
                query[b, h].double(), key[:, kvh], value[:, kvh], key.shape[0], scale
            )
            torch.testing.assert_close(out[b, h].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8", "int4"])
def test_it_prefills_with_a_per_query_window_like_a_slow_loop(dtype):
    # Each query sees the `window` positions up to its own in bf16 and every older
    # one quantized, wherever its chunk ends.
    shape = WINDOW_SHAPES[1]
    num_heads, num_kv_heads, head_dim, _, window = shape
    query, cache, tables, qsl, ctx, rows, written, (k_new, v_new, _) = (
        window_prefill_inputs(dtype, shape, seed=21)
    )
    scale = head_dim**-0.5

    out = kernels.paged_prefill_attention(
        query, cache, tables, qsl, ctx, scale, rows, k_new, v_new, impl="reference"
    )

    for b, (key, value) in enumerate(written):
        new, length = WINDOW_PREFILL_CHUNKS[b][-1], key.shape[0]
        for i in range(new):
            token, position = int(qsl[b]) + i, length - new + i
            k = slow_per_query_kv(key, dtype, window, position)
            v = slow_per_query_kv(value, dtype, window, position)
            for h in range(num_heads):
                kvh = h // (num_heads // num_kv_heads)
                want = slow_attention_one(
                    query[token, h].double(), k[:, kvh], v[:, kvh], position + 1, scale
                )
                torch.testing.assert_close(
                    out[token, h].double(), want, atol=1e-5, rtol=1e-5
                )


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_chunked_and_unchunked_prefill_with_a_window_agree(dtype, impl):
    # One 45-token prompt (window 12) prefilled at once, or in chunks of 20, 7, 1
    # and 17 (each chunk's window written after its attention): every query's
    # output is the same.
    shape = WINDOW_SHAPES[1]
    num_heads, num_kv_heads, head_dim, block_size, window = shape
    g = torch.Generator().manual_seed(5)
    splits = [20, 7, 1, 17]
    total = sum(splits)
    query = torch.randn(total, num_heads, head_dim, generator=g)
    key = torch.randn(total, num_kv_heads, head_dim, generator=g)
    value = torch.randn(total, num_kv_heads, head_dim, generator=g)
    num_blocks = math.ceil(total / block_size)
    tables = torch.arange(num_blocks, dtype=torch.int32)[None]
    rows = torch.zeros(1, dtype=torch.int32)
    outs = {}
    for name, chunks in (("whole", [total]), ("chunked", splits)):
        cache = kernels.allocate_kv_cache(
            dtype, num_blocks, block_size, num_kv_heads, head_dim,
            window=window, num_windows=1,
        )  # fmt: skip
        pieces, start = [], 0
        for n in chunks:
            pos = torch.arange(start, start + n)
            ring = torch.where(pos >= start + n - window, pos % window, -1)
            kernels.write_kv(cache, key[pos], value[pos], pos, blocks_only=True)
            pieces.append(
                kernels.paged_prefill_attention(
                    query[pos], cache, tables,
                    torch.tensor([0, n], dtype=torch.int32),
                    torch.tensor([start + n], dtype=torch.int32),
                    head_dim**-0.5, rows, key[pos], value[pos], impl=impl,
                )
            )  # fmt: skip
            kernels.write_window(cache, key[pos], value[pos], ring)
            start += n
        outs[name] = torch.cat(pieces)
    torch.testing.assert_close(outs["chunked"], outs["whole"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8", "int4"])
@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_it_decodes_with_a_window_with_triton_like_the_reference(dtype, shape):
    num_heads, _, head_dim, block_size, window = shape
    chunks = window_decode_chunks(block_size, window)
    cache, tables, ctx, rows, _ = windowed_cache(dtype, shape, chunks, seed=22)
    query = torch.randn(len(chunks), num_heads, head_dim)

    got = kernels.paged_decode_attention(
        query, cache, tables, ctx, head_dim**-0.5, rows, impl="triton"
    )

    want = paged_decode_attention_reference(
        query, cache, tables, ctx, head_dim**-0.5, rows
    )
    atol, rtol = TOLERANCE["cpu"][dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8", "int4"])
@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_it_prefills_with_a_window_with_triton_like_the_reference(dtype, shape):
    query, cache, tables, qsl, ctx, rows, _, (k_new, v_new, _) = window_prefill_inputs(
        dtype, shape, seed=23
    )
    scale = shape[2] ** -0.5

    got = kernels.paged_prefill_attention(
        query, cache, tables, qsl, ctx, scale, rows, k_new, v_new, impl="triton"
    )

    want = kernels.paged_prefill_attention(
        query, cache, tables, qsl, ctx, scale, rows, k_new, v_new, impl="reference"
    )
    atol, rtol = TOLERANCE["cpu"][dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_it_matches_a_bf16_cache_exactly_when_the_window_covers_the_context(
    dtype, impl
):
    shape = (8, 2, 64, 8, 16)
    chunks = [[9], [12, 4], [1], [15, 1]]  # every context <= the window
    window_cache, tables, ctx, rows, _ = windowed_cache(dtype, shape, chunks, seed=24)
    # The same K/V (bf16 values) in bf16 blocks of the same block tables, no window.
    bf16_cache, *_ = filled_cache("bf16", shape[:4], [16, 16, 16, 16])
    bf16_cache.key.zero_()
    bf16_cache.value.zero_()
    for b, c in enumerate(ctx.tolist()):
        k, v = kernels.gather_kv(window_cache, tables[b], c, int(rows[b]))
        pos = torch.arange(c)
        slots = tables[b].long()[pos // 8] * 8 + pos % 8
        kernels.write_kv(bf16_cache, k, v, slots)
    query = torch.randn(4, 8, 64)
    qsl = torch.tensor([0, 9, 13, 14, 15], dtype=torch.int32)
    prefill_query = torch.randn(15, 8, 64)

    decode = [
        kernels.paged_decode_attention(query, cache, tables, ctx, 0.125, r, impl=impl)
        for cache, r in ((window_cache, rows), (bf16_cache, None))
    ]
    # Each sequence's last qsl-chunk: its own K/V, which its queries read from
    # the arguments (bf16 values, as the window holds them).
    own = [
        kernels.gather_kv(window_cache, tables[b], c, int(rows[b]))
        for b, c in enumerate(ctx.tolist())
    ]
    new = (qsl[1:] - qsl[:-1]).tolist()
    k_new = torch.cat([k[-n:] for (k, _), n in zip(own, new, strict=True)])
    v_new = torch.cat([v[-n:] for (_, v), n in zip(own, new, strict=True)])
    prefill = [
        kernels.paged_prefill_attention(
            prefill_query, cache, tables, qsl, ctx, 0.125, r, *kv, impl=impl
        )
        for cache, r, kv in (
            (window_cache, rows, (k_new, v_new)),
            (bf16_cache, None, ()),
        )
    ]

    if impl == "reference":
        # The reference's SDPA sees the windowed context as 2L keys (each position's
        # quantized and full copies side by side, one masked) and the bf16 one as L:
        # equal here, but the CPU's SDPA kernel may group the sums by vector lanes,
        # which then fall differently (seen on another CI machine). One position
        # read from the wrong copy brings its int8/int4 rounding error (~1e-2 of
        # the values, times its attention weight): orders above these bounds.
        for got, want in (prefill, decode):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        return
    assert torch.equal(prefill[0], prefill[1])
    if dtype == "int4":
        # The int4 decode kernel sums q.k as even + odd halves: another order.
        torch.testing.assert_close(decode[0], decode[1], atol=2e-5, rtol=2e-5)
    else:
        assert torch.equal(decode[0], decode[1])


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_it_rejects_missing_or_unexpected_window_rows(impl):
    shape = (4, 2, 64, 16, 8)
    windowed, tables, ctx, rows, _ = windowed_cache("int8", shape, [[3], [5]])
    plain, *_ = filled_cache("int8", shape[:4], [3, 5])
    query = torch.randn(2, 4, 64)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)

    def decode(cache, window_rows):
        return kernels.paged_decode_attention(
            query, cache, tables, ctx, 1.0, window_rows, impl=impl
        )

    def prefill(cache, window_rows):
        return kernels.paged_prefill_attention(
            query, cache, tables, qsl, ctx, 1.0, window_rows, impl=impl
        )

    for attend in (decode, prefill):
        with pytest.raises(ValueError, match="needs window_rows"):
            attend(windowed, None)
        with pytest.raises(ValueError, match="needs window_rows"):
            attend(windowed, rows.long())
        with pytest.raises(ValueError, match="needs window_rows"):
            attend(windowed, rows[:1])
        with pytest.raises(ValueError, match="has no window"):
            attend(plain, rows)
    with pytest.raises(ValueError, match="needs the chunk's key/value"):
        prefill(windowed, rows)


def relative_error_vs_bf16(dtype, head_dim, offset_scale, seed=5):
    """||attn(dtype KV) - attn(bf16 KV)|| / ||attn(bf16 KV)|| on one random batch."""
    shape = (8, 2, head_dim, 16)
    lens = [256, 200, 129]
    g = torch.Generator().manual_seed(seed + 100)
    # Per-channel means, as real K/V activations have (offset_scale 0: iid N(0, 1)).
    offset = (
        torch.randn(2, head_dim, generator=g) * offset_scale,
        torch.randn(2, head_dim, generator=g) * offset_scale,
    )
    query = torch.randn(3, 8, head_dim, generator=g)
    outs = {}
    for d in ("bf16", dtype):
        cache, tables, ctx, _ = filled_cache(d, shape, lens, seed=seed, offset=offset)
        outs[d] = kernels.paged_decode_attention(
            query, cache, tables, ctx, head_dim**-0.5
        )
    return float((outs[dtype] - outs["bf16"]).norm() / outs["bf16"].norm())


# Measured (seeds 0-4): iid N(0,1) K/V is the worst case for any scalar quantizer,
# since attention averages the per-element rounding noise no better than the signal:
# int8 ~0.9%, fp8 e4m3 ~3.6% (3 mantissa bits: ~2.5% per element), int4 ~14%
# (even the rate-distortion bound of a 4.25-bit code on a Gaussian is 5.3%).
IID_BOUND = {"int8": 0.013, "fp8-per-token": 0.05, "int4": 0.20}
# With per-channel means (the regime of real activations) the issue's bar holds.
ISSUE_BAR = {"int8": 0.01, "fp8-per-token": 0.01, "int4": 0.05}


@pytest.mark.parametrize("dtype", ["int8", "fp8-per-token", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_it_keeps_attention_error_within_the_format_limit_on_iid_data(dtype, head_dim):
    err = relative_error_vs_bf16(dtype, head_dim, offset_scale=0.0)

    assert err <= IID_BOUND[dtype]


@pytest.mark.parametrize("dtype", ["int8", "fp8-per-token", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_it_meets_the_quality_bar_on_data_with_channel_means(dtype, head_dim):
    err = relative_error_vs_bf16(dtype, head_dim, offset_scale=1.0)

    assert err <= ISSUE_BAR[dtype]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
@pytest.mark.parametrize("shape", [(32, 8, 128, 16), (32, 4, 64, 32), (8, 8, 128, 16)])
def test_it_decodes_like_the_reference_on_cuda(dtype, shape):
    lens = [1, 15, 17, 1000, 2049, 4096, 333]
    cache, tables, ctx, _ = filled_cache(dtype, shape, lens, seed=6, device="cuda")
    query = torch.randn(len(lens), shape[0], shape[2], device="cuda")

    got = kernels.paged_decode_attention(query, cache, tables, ctx, shape[2] ** -0.5)

    want = paged_decode_attention_reference(query, cache, tables, ctx, shape[2] ** -0.5)
    atol, rtol = TOLERANCE["cuda"][dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp8-per-token", "int8", "int4", "fp32"])
def test_it_prefills_like_the_reference_on_cuda(dtype):
    shape = (32, 8, 128, 16)
    lens = [700, 64, 1]
    cache, tables, ctx, _ = filled_cache(dtype, shape, lens, seed=7, device="cuda")
    qsl = torch.tensor([0, 300, 364, 365], dtype=torch.int32, device="cuda")
    query = torch.randn(365, 32, 128, device="cuda", dtype=torch.bfloat16)

    got = kernels.paged_prefill_attention(query, cache, tables, qsl, ctx, 128**-0.5)

    want = kernels.paged_prefill_attention(
        query, cache, tables, qsl, ctx, 128**-0.5, impl="reference"
    )
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8", "int4"])
def test_it_reads_the_window_like_the_reference_on_cuda(dtype):
    shape = (32, 8, 128, 16, 64)
    chunks = [[1], [63, 1], [64], [999, 1], [2000, 49], [300, 33]]
    cache, tables, ctx, rows, _ = windowed_cache(
        dtype, shape, chunks, seed=9, device="cuda"
    )
    query = torch.randn(len(chunks), 32, 128, device="cuda")
    qsl = torch.tensor([0] + [c[-1] for c in chunks], device="cuda").cumsum(0)
    qsl = qsl.to(torch.int32)
    prefill_query = torch.randn(int(qsl[-1]), 32, 128, device="cuda")

    decode = [
        kernels.paged_decode_attention(
            query, cache, tables, ctx, 128**-0.5, rows, impl=impl
        )
        for impl in ("triton", "reference")
    ]
    prefill = [
        kernels.paged_prefill_attention(
            prefill_query, cache, tables, qsl, ctx, 128**-0.5, rows, impl=impl
        )
        for impl in ("triton", "reference")
    ]

    atol, rtol = TOLERANCE["cuda"][dtype]
    torch.testing.assert_close(decode[0], decode[1], atol=atol, rtol=rtol)
    torch.testing.assert_close(prefill[0], prefill[1], atol=2e-2, rtol=2e-2)


def test_it_compiles_the_kernels_for_sm90_without_a_gpu():
    result = compile_for_sm90("paged_attention")

    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
