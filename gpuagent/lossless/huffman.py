"""Huffman-coded literal blocks in zstd frames, built with numpy (the streams' bits
written by `loops`).

zstd decodes Huffman-coded literals with 4 interleaved streams (what ZipNN's coder
runs too), faster than an inflater decodes DEFLATE's single stream, but its own
compressor always looks for matches, and on exponent bytes those cost 8-15% over
order-0 entropy. So the frame is written here (RFC 8878): one compressed block per
<= 128 KiB of symbols, each holding only a Huffman-compressed literals section (4
streams, weights in the direct 4-bit representation) and zero sequences. Any zstd
decoder reads it back; the frame records its content size.

The direct weight representation covers symbols 0..128, so a chunk's bytes are coded
relative to its smallest byte (`base`, kept by the caller) and a chunk spanning more
than 129 values, or holding a single value, is not coded here (`None`).
"""

from __future__ import annotations

import heapq
import struct

import numpy as np

from gpuagent.lossless.loops import huffman_stream

MAX_BLOCK_SYMBOLS = 128 << 10  # zstd's Block_Maximum_Size
MAX_SYMBOL = 128  # the direct representation stores at most 128 weights
MAX_CODE_BITS = 11  # zstd's Max_Number_of_Bits for literals
MIN_SYMBOLS = 1024  # below this a chunk is not worth 4 streams and a table
_MAGIC = b"\x28\xb5\x2f\xfd"
_SINGLE_SEGMENT_FCS4 = 0xA0  # Frame_Content_Size_flag 2 (4 bytes), single segment


def encode_frame(symbols: np.ndarray) -> bytes | None:
    """A zstd frame decoding to `symbols` (uint8 [n], all <= MAX_SYMBOL), or None
    when they cannot be coded this way (too few, one distinct value, a block
    that would not shrink)."""
    count = symbols.size
    if count < MIN_SYMBOLS or count >= 1 << 32 or int(symbols.max()) > MAX_SYMBOL:
        return None
    blocks = -(-count // MAX_BLOCK_SYMBOLS)
    per_block = -(-count // blocks)  # even split: no tiny last block
    parts = [_MAGIC, bytes([_SINGLE_SEGMENT_FCS4]), struct.pack("<I", count)]
    for begin in range(0, count, per_block):
        block = symbols[begin : begin + per_block]
        literals = _literals_section(block)
        if literals is None:
            return None
        size = len(literals) + 1  # + the Number_of_Sequences byte (0)
        if size >= block.size:
            return None
        last = int(begin + per_block >= count)
        parts.append(struct.pack("<I", last | (2 << 1) | (size << 3))[:3])
        parts.append(literals)
        parts.append(b"\x00")
    return b"".join(parts)


def _literals_section(block: np.ndarray) -> bytes | None:
    counts = np.bincount(block, minlength=MAX_SYMBOL + 1)
    present = np.flatnonzero(counts)
    if present.size < 2:
        return None
    lengths = np.zeros(MAX_SYMBOL + 1, dtype=np.int64)
    lengths[present] = limited_code_lengths(counts[present].tolist(), MAX_CODE_BITS)
    codes = canonical_codes(lengths)
    last_symbol = int(present[-1])
    max_bits = int(lengths.max())
    weights = np.where(lengths > 0, max_bits + 1 - lengths, 0)[:last_symbol]
    if weights.size % 2:
        weights = np.append(weights, 0)
    tree = bytes([127 + last_symbol]) + bytes(
        (weights[0::2] << 4 | weights[1::2]).astype(np.uint8)
    )
    segment = (block.size + 3) // 4
    # written in C (loops): numpy's bit packing was 3/4 of coding time
    codes32, lengths8 = codes.astype("<u4"), lengths.astype(np.uint8)
    streams = [
        huffman_stream(block[i * segment : (i + 1) * segment], codes32, lengths8)
        for i in range(4)
    ]
    if any(len(s) > 0xFFFF for s in streams[:3]):
        return None
    jump = struct.pack("<3H", *(len(s) for s in streams[:3]))
    compressed = len(tree) + len(jump) + sum(len(s) for s in streams)
    if compressed >= 1 << 18:
        return None
    # Literals_Block_Type 2 (compressed), Size_Format 3 (4 streams, 18-bit sizes)
    header = 2 | (3 << 2) | (block.size << 4) | (compressed << 22)
    return header.to_bytes(5, "little") + tree + jump + b"".join(streams)


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """zstd's canonical prefix codes: longest codes first, from 0, each length's
    symbols in increasing order."""
    codes = np.zeros_like(lengths)
    next_code = 0
    for bits in range(int(lengths.max()), 0, -1):
        symbols = np.flatnonzero(lengths == bits)
        codes[symbols] = next_code + np.arange(symbols.size)
        next_code = (next_code + symbols.size) >> 1
    return codes


def limited_code_lengths(counts: list[int], limit: int) -> list[int]:
    """Huffman code lengths for `counts` (>= 2 symbols), none over `limit`, and
    complete (Kraft sum exactly 1, as zstd's implied last weight requires)."""
    heap = [(c, i, [i]) for i, c in enumerate(counts)]
    heapq.heapify(heap)
    lengths = [0] * len(counts)
    tiebreak = len(counts)
    while len(heap) > 1:
        c1, _, s1 = heapq.heappop(heap)
        c2, _, s2 = heapq.heappop(heap)
        for s in s1 + s2:
            lengths[s] += 1
        heapq.heappush(heap, (c1 + c2, tiebreak, s1 + s2))
        tiebreak += 1
    if max(lengths) <= limit:
        return lengths
    lengths = [min(n, limit) for n in lengths]
    full = 1 << limit
    kraft = sum(1 << (limit - n) for n in lengths)
    by_rarity = sorted(range(len(counts)), key=lambda i: counts[i])
    while kraft > full:  # lengthen the rarest code that can still grow
        i = max(
            (i for i in by_rarity if lengths[i] < limit),
            key=lambda i: (lengths[i], -counts[i]),
        )
        lengths[i] += 1
        kraft -= 1 << (limit - lengths[i])
    for i in reversed(by_rarity):  # then shorten the commonest codes that fit
        while lengths[i] > 1 and kraft + (1 << (limit - lengths[i])) <= full:
            kraft += 1 << (limit - lengths[i])
            lengths[i] -= 1
    assert kraft == full
    return lengths


def frame_size(frame: bytes | memoryview) -> int:
    """Bytes of the frame at the start of `frame`, as `encode_frame` lays it out
    (9-byte header, compressed blocks only, no checksum); ValueError otherwise. A
    zstd decoder ignores what follows a frame: the caller compares."""
    if bytes(frame[:4]) != _MAGIC or len(frame) < 9:
        raise ValueError("not a zstd frame")
    if frame[4] != _SINGLE_SEGMENT_FCS4:
        raise ValueError(f"frame header descriptor {frame[4]:#x} is not this layout")
    at = 9
    while True:
        if at + 3 > len(frame):
            raise ValueError("frame ends inside a block header")
        header = int.from_bytes(frame[at : at + 3], "little")
        if (header >> 1) & 3 != 2:
            raise ValueError(f"block of type {(header >> 1) & 3}, not compressed")
        at += 3 + (header >> 3)
        if header & 1:
            return at
