"""gpuagent.compress.lossless_huffman: frames libzstd decodes to the symbols."""

import numpy as np
import pytest
import zstandard

from gpuagent.compress.lossless_huffman import (
    MAX_SYMBOL,
    canonical_codes,
    encode_frame,
    frame_size,
    limited_code_lengths,
)


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
