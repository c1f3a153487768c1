"""Exponent and sign+mantissa planes of IEEE floats, and their chunked coding.

A float of W bits is `sign | exponent | mantissa`. The *exponent plane* is one byte
per element: for 16-bit words bits 14..7 (bf16's exponent exactly; fp16's 5-bit
exponent and 3 top mantissa bits), for fp32 the exponent, taken from the word rotated
left by one bit. Trained weights use few exponents (about 2.6 bits of entropy in 8),
so it is Huffman-coded. The other W/8 - 1 bytes per element are the *rest plane*:
for 16-bit words `sign | mantissa bits 6..0` (ZipNN's layout; merged back into words
in one pass by `loops`), for fp32 the rotated word's low bytes, mantissa then
sign. They are near random, stored raw unless coding saves at least `MIN_SAVING`.
DFloat11 likewise codes only the exponent and keeps sign and mantissa as they are.

Both planes are cut into chunks of `chunk_elements` elements, each coded on its own:
- "h": a zstd frame of Huffman-coded literals written by `huffman` (order-0
  entropy coding; libzstd decodes its 4 interleaved streams, the coder ZipNN runs);
  the chunk's bytes are coded minus their smallest value, kept in a leading byte;
- "d": a raw DEFLATE stream written by zlib with `Z_HUFFMAN_ONLY`, read by ISA-L,
  for chunks "h" cannot take (bytes spanning more than 129 values, NaN/inf beside
  weights, a single value, under 1024 bytes);
- "r": raw, when order-0 entropy promises less than `MIN_SAVING`.
zstd's own compressor was not used: its match finder cost 8-15% over order-0 entropy
on exponent bytes, whose short repeats are not worth an offset. Chunks are coded on a
thread pool and decoded in one contiguous run of chunks per thread (zlib, zstd, ISA-L
and numpy release the GIL); each chunk is merged into its output words while in cache.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import zstandard
from isal import isal_zlib

from gpuagent.lossless import huffman
from gpuagent.lossless.loops import merge16

# safetensors dtype name -> the unsigned little-endian word holding one element
WORD_TYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<u2"),
    "F32": np.dtype("<u4"),
}
# Per-chunk codec letters in a plane's `codecs` string: raw bytes; a raw DEFLATE
# stream; a byte `base` then a zstd frame of Huffman literals (huffman)
# decoding to the bytes minus `base`.
RAW, DEFLATE, HUFFMAN = "r", "d", "h"
CODEC_LETTERS = (RAW, DEFLATE, HUFFMAN)
DEFAULT_CHUNK_ELEMENTS = 1 << 18
MAX_CHUNK_ELEMENTS = 1 << 24
# A chunk is coded only when its order-0 entropy promises this fraction saved.
MIN_SAVING = 0.02
_ENTROPY_SAMPLE = 1 << 14
_RAW_DEFLATE_WBITS = -15

T = TypeVar("T")
R = TypeVar("R")


class PlaneDecodeError(ValueError):
    """A plane's bytes do not decode to what its description says."""


@dataclass(frozen=True)
class CodedPlane:
    """One plane of one tensor: each chunk's codec letter and size, and the chunks
    concatenated in `data`."""

    codecs: str
    chunk_bytes: tuple[int, ...]
    data: bytes | memoryview  # a view into the container when read from one


@dataclass(frozen=True)
class CodedWords:
    """The two planes of a flat array of float words."""

    exponent: CodedPlane
    rest: CodedPlane


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def chunk_bounds(count: int, chunk_elements: int) -> list[tuple[int, int]]:
    """[begin, end) element ranges of the chunks of `count` elements."""
    return [
        (begin, min(begin + chunk_elements, count))
        for begin in range(0, count, chunk_elements)
    ]


def split_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exponent plane uint8 [n], rest plane uint8 [W/8 - 1, n]) of words [n]."""
    size = words.dtype.itemsize
    if size == 2:
        exponent = (words >> 7).astype(np.uint8)  # bits 14..7
        rest = (words & 0x7F) | ((words >> 8) & 0x80)  # sign to bit 7
        return exponent, rest.astype(np.uint8)[None, :]
    rotated = (words << 1) | (words >> (8 * size - 1))  # exponent|mantissa|sign
    as_bytes = rotated.view(np.uint8).reshape(-1, size)  # [n, W/8], little-endian
    exponent = np.ascontiguousarray(as_bytes[:, -1])
    return exponent, np.ascontiguousarray(as_bytes[:, :-1].T)  # byte-planar rest


def merge_words(
    exponent: np.ndarray,
    rest: np.ndarray,
    out: np.ndarray,
    *,
    exponent_base: int = 0,
    rest_base: int = 0,
) -> None:
    """Inverse of `split_words`, written into `out` (words [n]), the plane bytes
    being stored minus `exponent_base` and `rest_base` (mod 256)."""
    size = out.dtype.itemsize
    if size == 2:
        # one pass in C (loops): numpy took four on 16-bit lanes, as much
        # time as the Huffman decoding
        merge16(exponent, rest[0], out.view(np.uint8), exponent_base, rest_base)
        return
    if rest_base:
        rest = rest + np.uint8(rest_base)
    as_bytes = out.view(np.uint8).reshape(-1, size)  # [n, W/8]
    as_bytes[:, -1] = exponent
    if exponent_base:
        as_bytes[:, -1] += np.uint8(exponent_base)
    as_bytes[:, :-1] = rest.T
    low = out >> 1
    np.left_shift(out, 8 * size - 1, out=out)
    np.bitwise_or(out, low, out=out)


def _entropy_bits(plane: np.ndarray) -> float:
    """Order-0 entropy in bits per byte (what a Huffman code nearly reaches)."""
    counts = np.bincount(plane.reshape(-1), minlength=256)
    p = counts[counts > 0] / plane.size
    return float(-(p * np.log2(p)).sum())


def _code_chunk(plane: np.ndarray) -> tuple[str, bytes]:
    raw = plane.tobytes()
    # Judged on a strided sample: a full count cost 13% of coding time, spent
    # mostly on near-random rest planes.
    sample = plane.reshape(-1)[:: max(1, plane.size // _ENTROPY_SAMPLE)]
    if plane.size == 0 or _entropy_bits(sample) > 8 * (1 - MIN_SAVING):
        return RAW, raw
    base = int(plane.min())
    if int(plane.max()) - base <= huffman.MAX_SYMBOL:
        frame = huffman.encode_frame(plane.reshape(-1) - np.uint8(base))
        if frame is not None and len(frame) + 1 < len(raw):
            return HUFFMAN, bytes([base]) + frame
    deflater = zlib.compressobj(
        1, zlib.DEFLATED, _RAW_DEFLATE_WBITS, 9, zlib.Z_HUFFMAN_ONLY
    )
    coded = deflater.compress(raw) + deflater.flush()
    return (DEFLATE, coded) if len(coded) < len(raw) else (RAW, raw)


def _plane(chunks: list[tuple[str, bytes]]) -> CodedPlane:
    return CodedPlane(
        codecs="".join(codec for codec, _ in chunks),
        chunk_bytes=tuple(len(data) for _, data in chunks),
        data=b"".join(data for _, data in chunks),
    )


def encode_words(
    words: np.ndarray,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    pool: concurrent.futures.Executor | None = None,
) -> CodedWords:
    """Split flat `words` into planes and code them chunk by chunk."""

    def code(bound: tuple[int, int]) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
        exponent, rest = split_words(words[bound[0] : bound[1]])
        return _code_chunk(exponent), _code_chunk(rest)

    coded = list(_map(pool, code, chunk_bounds(words.size, chunk_elements)))
    return CodedWords(_plane([e for e, _ in coded]), _plane([r for _, r in coded]))


def decode_words(
    items: list[tuple[str, CodedWords, np.ndarray]],
    *,
    chunk_elements: int,
    threads: int = 1,
) -> None:
    """Decode each (name, coded planes, flat output words) in place; raises
    PlaneDecodeError, naming the item and chunk, when a chunk does not decode to
    exactly its size. The planes' codecs and chunk sizes must already have been
    checked against the chunk count (see `check_plane`).

    The chunks of all items are dealt out in `threads` contiguous runs of about
    equal size, one task each: a task per chunk cost more CPU in dispatch than
    the merge."""
    jobs = [
        (item, index, begin, end)
        for item, (_, _, out) in enumerate(items)
        for index, (begin, end) in enumerate(chunk_bounds(out.size, chunk_elements))
    ]
    offsets = [
        (_offsets(coded.exponent.chunk_bytes), _offsets(coded.rest.chunk_bytes))
        for _, coded, _ in items
    ]

    def run(part: list[tuple[int, int, int, int]]) -> None:
        for item, index, begin, end in part:
            name, coded, out = items[item]
            exponent_at, rest_at = offsets[item]
            rest_rows = out.dtype.itemsize - 1
            count = end - begin
            exponent, base = _decode_chunk(
                coded.exponent.codecs[index],
                memoryview(coded.exponent.data)[
                    exponent_at[index] : exponent_at[index + 1]
                ],
                count,
                f"{name}: exponent chunk {index}",
            )
            rest, rest_base = _decode_chunk(
                coded.rest.codecs[index],
                memoryview(coded.rest.data)[rest_at[index] : rest_at[index + 1]],
                count * rest_rows,
                f"{name}: rest chunk {index}",
            )
            merge_words(
                exponent,
                rest.reshape(rest_rows, count),
                out[begin:end],
                exponent_base=base,
                rest_base=rest_base,
            )

    parts = _deal(jobs, threads)
    if len(parts) < 2:
        run(jobs)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(parts)) as pool:
        for _ in pool.map(run, parts):
            pass


def _deal(jobs: list[tuple[int, int, int, int]], parts: int) -> list[list]:
    """`jobs` cut into at most `parts` contiguous runs of about equal elements."""
    total = sum(end - begin for _, _, begin, end in jobs)
    runs: list[list] = [[]]
    done = 0
    for job in jobs:
        if runs[-1] and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(job)
        done += job[3] - job[2]
    return runs


def check_plane(
    codecs: str,
    chunk_bytes: list[int],
    *,
    count: int,
    chunk_elements: int,
    bytes_per_element: int,
) -> None:
    """Raises PlaneDecodeError unless a plane of `count` elements in chunks of
    `chunk_elements` can have these codecs and sizes: one valid codec letter and
    one size per chunk, and a raw chunk exactly its size. The chunk count is
    compared first, so a huge `count` costs nothing."""
    chunks = -(-count // chunk_elements)
    if len(codecs) != chunks or len(chunk_bytes) != chunks:
        raise PlaneDecodeError(
            f"{len(codecs)} codecs and {len(chunk_bytes)} chunk sizes for "
            f"{chunks} chunks"
        )
    for index, (codec, size, (begin, end)) in enumerate(
        zip(codecs, chunk_bytes, chunk_bounds(count, chunk_elements), strict=True)
    ):
        if codec not in CODEC_LETTERS:
            raise PlaneDecodeError(f"chunk {index}: unknown codec {codec!r}")
        expected = (end - begin) * bytes_per_element
        if codec == RAW and size != expected:
            raise PlaneDecodeError(
                f"chunk {index}: raw chunk of {size} bytes, {expected} expected"
            )


_local = threading.local()


def _decode_chunk(
    codec: str, data: memoryview, size: int, where: str
) -> tuple[np.ndarray, int]:
    """(the chunk's bytes, a base to add to each: nonzero only for HUFFMAN)"""
    if codec == RAW:
        return np.frombuffer(data, dtype=np.uint8), 0
    if codec == HUFFMAN:
        return _decode_huffman(data, size, where), data[0]
    inflater = isal_zlib.decompressobj(_RAW_DEFLATE_WBITS)
    try:
        decoded = inflater.decompress(data, size + 1)
    except isal_zlib.error as exc:
        raise PlaneDecodeError(f"{where}: corrupt DEFLATE stream: {exc}") from exc
    if len(decoded) > size:
        raise PlaneDecodeError(f"{where}: decodes to more than {size} bytes")
    if len(decoded) < size or not inflater.eof:
        raise PlaneDecodeError(
            f"{where}: DEFLATE stream ends early ({len(decoded)} of {size} bytes)"
        )
    if inflater.unused_data or inflater.unconsumed_tail:
        raise PlaneDecodeError(f"{where}: bytes after the end of its DEFLATE stream")
    return np.frombuffer(decoded, dtype=np.uint8), 0


def _decode_huffman(data: memoryview, size: int, where: str) -> np.ndarray:
    frame = data[1:]
    try:
        frame_bytes = huffman.frame_size(frame)
        content_size = zstandard.frame_content_size(frame)
    except (ValueError, zstandard.ZstdError) as exc:
        raise PlaneDecodeError(f"{where}: {exc}") from exc
    if frame_bytes != len(frame):
        raise PlaneDecodeError(f"{where}: {len(frame) - frame_bytes} bytes too many")
    if content_size != size:
        raise PlaneDecodeError(
            f"{where}: zstd frame of {content_size} bytes, {size} expected"
        )
    # A decompressor holds a context two threads must not share.
    if not hasattr(_local, "zstd"):
        _local.zstd = zstandard.ZstdDecompressor()
    try:
        decoded = _local.zstd.decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise PlaneDecodeError(f"{where}: corrupt zstd frame: {exc}") from exc
    if len(decoded) != size:
        raise PlaneDecodeError(f"{where}: decodes to {len(decoded)} of {size} bytes")
    return np.frombuffer(decoded, dtype=np.uint8)


def _offsets(sizes: Iterable[int]) -> list[int]:
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def _map(
    pool: concurrent.futures.Executor | None, fn: Callable[[T], R], items: Iterable[T]
) -> Iterator[R]:
    items = list(items)
    if pool is None or len(items) < 2:
        return map(fn, items)
    return pool.map(fn, items)
