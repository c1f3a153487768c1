"""gpuagent.lossless.huffman: frames libzstd decodes to the symbols."""

import numpy as np
import pytest
import zstandard

from gpuagent.lossless.huffman import (
    MAX_SYMBOL,
    canonical_codes,
    encode_frame,
    frame_size,
    limited_code_lengths,
)
from gpuagent.lossless.loops import huffman_stream


def _symbols(kind, count, rng):
    if kind == "geometric":
        return np.minimum(rng.geometric(0.3, count), MAX_SYMBOL).astype(np.uint8)
    if kind == "uniform":
        return rng.integers(0, MAX_SYMBOL + 1, count).astype(np.uint8)
    if kind == "two":
        return rng.integers(0, 2, count).astype(np.uint8) * MAX_SYMBOL
    # one dominant value and rare outliers: the longest codes, length-limited
    out = np.full(count, 7, np.uint8)
    out[rng.integers(0, count, 40)] = rng.integers(0, MAX_SYMBOL + 1, 40)
    return out


@pytest.mark.parametrize("kind", ["geometric", "uniform", "two", "skewed"])
@pytest.mark.parametrize("count", [1024, 1025, 4099, 131_072, 131_073, 300_001])
def test_it_writes_frames_libzstd_decodes_exactly(kind, count):
    symbols = _symbols(kind, count, np.random.default_rng(count))

    frame = encode_frame(symbols)

    assert frame is not None
    assert zstandard.frame_content_size(frame) == count
    assert zstandard.ZstdDecompressor().decompress(frame) == symbols.tobytes()
    assert frame_size(frame + b"tail") == len(frame)


def test_it_declines_what_it_cannot_code():
    assert encode_frame(np.zeros(1023, np.uint8)) is None  # too few
    assert encode_frame(np.full(5000, 3, np.uint8)) is None  # one value
    assert encode_frame(np.full(5000, MAX_SYMBOL + 1, np.uint8)) is None


def test_it_limits_code_lengths_and_keeps_the_code_complete():
    fibonacci = [1, 1]
    while len(fibonacci) < 30:
        fibonacci.append(fibonacci[-1] + fibonacci[-2])

    lengths = limited_code_lengths(fibonacci, 11)

    assert max(lengths) == 11
    assert sum(2.0**-n for n in lengths) == 1.0
    assert lengths[-1] <= lengths[0]  # the commonest symbol gets a short code


def test_it_assigns_zstd_canonical_codes():
    # RFC 8878's example: weights 4 3 2 0 1 1 -> lengths 1 2 3 - 4 4
    codes = canonical_codes(np.array([1, 2, 3, 0, 4, 4]))

    assert [int(c) for c in codes[[0, 1, 2, 4, 5]]] == [
        0b1,
        0b01,
        0b001,
        0b0000,
        0b0001,
    ]


def test_it_refuses_frames_of_another_layout():
    frame = encode_frame(np.minimum(np.arange(5000) % 7, 6).astype(np.uint8))
    with pytest.raises(ValueError, match="not a zstd frame"):
        frame_size(b"\x00" + frame)
    with pytest.raises(ValueError, match="descriptor"):
        frame_size(zstandard.ZstdCompressor().compress(b"x" * 5000))
    with pytest.raises(ValueError, match="inside a block header"):
        frame_size(frame[:10])


def test_a_stream_puts_the_first_code_under_the_end_mark():
    """RFC 8878 4.2.2, by hand: codes 0 -> '1', 1 -> '01'; the stream of [0, 1]
    read backward from the end mark is end(1), '1', '01': 0b1101, one byte. 17
    symbols 1 (34 bits) need a fifth byte, the end mark in its bit 2."""
    codes = np.array([0b1, 0b01], dtype="<u4")
    lengths = np.array([1, 2], dtype=np.uint8)
    assert huffman_stream(np.array([0, 1], np.uint8), codes, lengths) == b"\x0d"
    ones = huffman_stream(np.ones(17, np.uint8), codes, lengths)
    assert ones == bytes([0x55, 0x55, 0x55, 0x55, 0b101])


def test_a_stream_refuses_symbols_and_codes_it_cannot_write():
    codes = np.array([0, 1], dtype="<u4")
    lengths = np.array([1, 1], dtype=np.uint8)
    with pytest.raises(ValueError, match="symbol 2 at 1 has no code"):
        huffman_stream(np.array([0, 2], np.uint8), codes, lengths)
    with pytest.raises(ValueError, match="8 code bytes for 3 lengths"):
        huffman_stream(np.zeros(4, np.uint8), codes, np.ones(3, np.uint8))
    with pytest.raises(ValueError, match="symbol 1 has code 2 in 1 bits"):
        huffman_stream(np.zeros(4, np.uint8), np.array([0, 2], "<u4"), lengths)
    with pytest.raises(ValueError, match="symbol 0 has code 0 in 25 bits"):
        huffman_stream(np.zeros(4, np.uint8), codes, np.array([25, 1], np.uint8))
