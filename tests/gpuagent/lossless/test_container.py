"""gpuagent.lossless.container: bit-exact round trips and a strict container."""

import json
import math
import struct
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpuagent.integrity import inspect_model
from gpuagent.lossless.container import (
    CONTAINER_FILE,
    LosslessFormatError,
    compress_folder,
    compress_tensor,
    decode_checkpoint,
    decode_tensors,
    decompress_folder,
    decompress_tensor,
    encode_checkpoint,
    read_container,
    read_weights,
    tensors_digest,
)
from gpuagent.lossless.loops import merge16
from gpuagent.lossless.planes import merge_words, split_words

DEMO_MODEL = "gpuagent/engine/demo_model"
SIZES = [0, 1, 2, 5, 127, 1000, 4099, 70_001]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT = {2: torch.int16, 4: torch.int32}


def _bits(t):
    return t.contiguous().view(INT[t.element_size()])


def _random_tensor(count, dtype, seed):
    """Gaussian weights at several scales, then every special bit pattern: NaNs
    with payloads and both signs, infinities, signed zeros, subnormals."""
    g = torch.Generator().manual_seed(seed)
    t = (
        torch.randn(count, generator=g)
        * 10 ** torch.randint(-6, 3, (count,), generator=g)
    ).to(dtype)
    bits = _bits(t).clone()
    width = t.element_size() * 8
    specials = {
        16: [0x7FC1, -0x0001, 0x7F80, -0x0080, 0x0000, -0x8000, 0x0001, 0x007F, 0x7E01],
        32: [0x7FC00001, -1, 0x7F800000, -0x800000, 0, -(2**31), 1, 0x7FFFFF],
    }[width if width == 32 else 16]
    if dtype == torch.float16:  # fp16 NaN/inf and subnormals
        specials = [0x7E01, -0x0001, 0x7C00, -0x0400, 0x0000, -0x8000, 0x0001, 0x03FF]
    for i, value in enumerate(specials[:count]):
        bits[(i * 7919) % count] = value
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", SIZES)
def test_it_round_trips_random_tensors_bit_for_bit(dtype, count):
    tensor = _random_tensor(count, dtype, seed=count)

    back = decompress_tensor(compress_tensor(tensor, chunk_elements=4096))

    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(_bits(back), _bits(tensor))


def test_it_round_trips_shapes_and_uniform_bits():
    g = torch.Generator().manual_seed(1)
    tensors = {
        "odd": torch.randn(3, 0, 5).to(torch.bfloat16),
        "cube": torch.randn(7, 11, 13).to(torch.float16),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        # every bit pattern equally likely: nothing to code, stored raw
        "noise": torch.randint(-(2**15), 2**15, (9001,), generator=g, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16),
        "constant": torch.ones(50_000, dtype=torch.bfloat16),
    }

    back = decode_checkpoint(encode_checkpoint(tensors, chunk_elements=1024))

    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].shape == t.shape and torch.equal(_bits(back[name]), _bits(t))


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_decoding_on_several_threads_gives_every_tensor_bit_for_bit(threads):
    tensors = {
        f"t{i}": _random_tensor(count, dtype, seed=i)
        for i, (count, dtype) in enumerate(
            [(70_001, torch.bfloat16), (5, torch.float16), (30_000, torch.float32)]
            + [(4099, torch.bfloat16)] * 4
        )
    }
    # rest planes that code (fp16's low mantissa bits all zero) beside raw ones
    tensors["coded_rest"] = (
        (torch.randn(20_000) * 0.02)
        .to(torch.float16)
        .view(torch.int16)
        .bitwise_and(-0x40)
        .view(torch.float16)
    )
    encoded = read_container(encode_checkpoint(tensors, chunk_elements=1024)).tensors
    assert "d" in encoded["coded_rest"].planes.rest.codecs  # not all raw

    back = decode_tensors(encoded, threads=threads)

    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(_bits(back[name]), _bits(t)), name


def test_a_corrupt_chunk_decoded_by_one_of_several_workers_is_named():
    g = torch.Generator().manual_seed(5)
    tensors = {
        f"t{i}": (torch.randn(9000, generator=g) * 0.02).to(torch.bfloat16)
        for i in range(6)
    }
    encoded = dict(
        read_container(encode_checkpoint(tensors, chunk_elements=1024)).tensors
    )
    exponent = encoded["t4"].planes.exponent
    assert exponent.codecs[5] == "h"
    at = sum(exponent.chunk_bytes[:5]) + 1  # chunk 5's zstd magic, after its base
    flipped = bytearray(exponent.data)
    flipped[at] ^= 0xFF
    corrupt = replace(exponent, data=bytes(flipped))
    encoded["t4"] = replace(
        encoded["t4"], planes=replace(encoded["t4"].planes, exponent=corrupt)
    )

    # unverified: only the worker's own error can report it
    with pytest.raises(LosslessFormatError, match="t4: exponent chunk 5"):
        decode_tensors(encoded, threads=3, verify=False)


def test_it_round_trips_every_tensor_of_the_demo_model_in_bf16_and_fp16():
    source = read_weights(DEMO_MODEL)
    # fp16's top byte holds 3 mantissa bits besides the 5-bit exponent
    for dtype, most in ((torch.bfloat16, 0.68), (torch.float16, 0.88)):
        tensors = {n: t.to(dtype) for n, t in source.items()}
        data = encode_checkpoint(tensors)

        back = decode_checkpoint(data)

        assert tensors_digest(back) == tensors_digest(tensors)
        assert all(torch.equal(_bits(back[n]), _bits(t)) for n, t in tensors.items())
        assert len(data) < most * sum(t.numel() * 2 for t in tensors.values())


def test_it_round_trips_every_tensor_of_the_real_model_in_bf16(real_model_dir):
    tensors = {n: t.to(torch.bfloat16) for n, t in read_weights(real_model_dir).items()}
    data = encode_checkpoint(tensors)

    back = decode_checkpoint(data)

    assert set(back) == set(tensors)
    assert all(torch.equal(_bits(back[n]), _bits(t)) for n, t in tensors.items())
    bf16_bytes = sum(t.numel() * 2 for t in tensors.values())
    assert len(data) / bf16_bytes < 0.68  # exponent entropy ~2.66 bits of 8


def test_it_refuses_other_dtypes_and_bad_names():
    with pytest.raises(LosslessFormatError, match="torch.int8"):
        compress_tensor(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(LosslessFormatError, match="'ids': 'torch.int64'"):
        encode_checkpoint({"ids": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(LosslessFormatError, match="':'"):
        encode_checkpoint({"a:b": torch.zeros(3, dtype=torch.bfloat16)})


# --- a corrupted container is refused, naming the problem ------------------------


def _container():
    g = torch.Generator().manual_seed(2)
    tensors = {
        "w": (torch.randn(64, 300, generator=g) * 0.02).to(torch.bfloat16),
        "b": torch.randn(300, generator=g).to(torch.float16),
    }
    return encode_checkpoint(tensors, chunk_elements=4096)


def _split(data):
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return header, data[8 + n :]


def _join(header, body):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _edit_lossless_header(data, edit):
    header, body = _split(data)
    inner = json.loads(header["__metadata__"]["releasegate.lossless"])
    edit(inner)
    header["__metadata__"]["releasegate.lossless"] = json.dumps(inner)
    return _join(header, body)


def _flip_byte(data, entry_name, offset):
    header, body = _split(data)
    begin = header[entry_name]["data_offsets"][0] + offset
    body = bytearray(body)
    body[begin] ^= 0x40
    return _join(header, bytes(body))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h.update(version=2), "version 2"),
        (lambda h: h.update(extra=1), r"unknown fields \['extra'\]"),
        (lambda h: h.pop("tensors_blake3"), r"missing fields \['tensors_blake3'\]"),
        (lambda h: h.update(chunk_elements=0), "chunk_elements 0"),
        (lambda h: h["tensors"]["w"].update(dtype="F64"), "dtype 'F64'"),
        (lambda h: h["tensors"]["w"].update(shape=[64, -300]), "shape"),
        (lambda h: h["tensors"]["w"].update(shape=[64, 301]), "chunk"),
        # a vast shape is refused by its chunk count, before anything is built
        (lambda h: h["tensors"]["w"].update(shape=[2**39] * 8), "chunk sizes for"),
        (lambda h: h["tensors"]["w"].update(blake3="00"), "hex digest"),
        (lambda h: h["tensors"]["w"]["rest"].update(codecs="x" * 5), "unknown codec"),
        (lambda h: h["tensors"]["w"]["exponent"]["chunk_bytes"].append(0), "chunk"),
        (lambda h: h["tensors"]["w"]["exponent"].update(level=3), "unknown fields"),
        (lambda h: h["tensors"].pop("b"), r"unexpected \['b:exponent', 'b:rest'\]"),
        (lambda h: h["tensors"]["w"].update(blake3="0" * 64), "recorded blake3"),
    ],
)
def test_it_refuses_a_container_with_a_bad_header(edit, message):
    data = _edit_lossless_header(_container(), edit)

    with pytest.raises(LosslessFormatError, match=message):
        decode_checkpoint(data)


def test_it_refuses_corrupted_plane_bytes():
    data = _container()
    # a bit flipped in a Huffman-coded exponent chunk, then in a raw rest chunk
    with pytest.raises(LosslessFormatError, match=r"w: .*exponent chunk 0|w: .*blake3"):
        decode_checkpoint(_flip_byte(data, "w:exponent", 40))
    with pytest.raises(LosslessFormatError, match="w: decoded bytes do not match"):
        decode_checkpoint(_flip_byte(data, "w:rest", 5))


def test_it_refuses_truncated_and_non_container_files():
    data = _container()
    with pytest.raises(LosslessFormatError, match="not a valid safetensors file"):
        decode_checkpoint(data[:-3])
    with pytest.raises(LosslessFormatError, match="no 'releasegate.lossless' header"):
        decode_checkpoint(open(f"{DEMO_MODEL}/model.safetensors", "rb").read())


def test_it_bounds_what_a_container_may_decode_to():
    with pytest.raises(LosslessFormatError, match="max_decoded_bytes=1000"):
        read_container(_container(), max_decoded_bytes=1000)


# --- folders ------------------------------------------------------------------------


def test_it_compresses_and_decompresses_folders(tmp_path, bf16_demo_folder):
    source = bf16_demo_folder

    result = compress_folder(source, tmp_path / "lossless")
    restored = decompress_folder(tmp_path / "lossless", tmp_path / "restored")

    files = sorted(p.name for p in (tmp_path / "lossless").iterdir())
    assert CONTAINER_FILE in files and "model.safetensors" not in files
    assert "config.json" in files and "tokenizer.json" in files
    inspect_model(tmp_path / "lossless")  # the gate accepts the container
    original = load_file(source / "model.safetensors")
    assert tensors_digest(load_file(restored / "model.safetensors")) == tensors_digest(
        original
    )
    assert result.tensors_blake3 == tensors_digest(original)
    assert (
        result.compressed_bytes
        == (tmp_path / "lossless" / CONTAINER_FILE).stat().st_size
    )
    assert 0.6 < result.ratio < 0.72
    assert (restored / "config.json").read_bytes() == (
        source / "config.json"
    ).read_bytes()


def test_it_refuses_an_existing_output_and_leaves_nothing_behind(
    tmp_path, bf16_demo_folder
):
    source = bf16_demo_folder
    (tmp_path / "taken").mkdir()

    with pytest.raises(LosslessFormatError, match="already exists"):
        compress_folder(source, tmp_path / "taken")

    assert list((tmp_path / "taken").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16", "taken"]


def test_it_refuses_a_source_that_fails_inspection(tmp_path, bf16_demo_folder):
    from gpuagent.integrity.errors import ModelRejectedError

    source = bf16_demo_folder
    (source / "extra.bin").write_bytes(b"\x80\x04K\x01.")

    with pytest.raises(ModelRejectedError):
        compress_folder(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_it_reports_sizes_that_add_up():
    tensors = {"w": torch.randn(1000, 10).to(torch.bfloat16)}
    encoded = compress_tensor(tensors["w"], chunk_elements=3000)

    assert encoded.original_bytes == 20_000
    assert len(encoded.planes.exponent.codecs) == math.ceil(10_000 / 3000)
    assert encoded.compressed_bytes == sum(encoded.planes.exponent.chunk_bytes) + sum(
        encoded.planes.rest.chunk_bytes
    )
    assert np.isclose(
        encoded.compressed_bytes / encoded.original_bytes, 0.67, atol=0.05
    )


def test_it_refuses_bytes_after_a_coded_chunk_and_corrupt_frames():
    tensor = (torch.randn(20_000) * 0.02).to(torch.bfloat16)
    encoded = compress_tensor(tensor, chunk_elements=8192)
    exponent = encoded.planes.exponent
    assert exponent.codecs == "hhh"
    longer = replace(
        exponent,
        chunk_bytes=(exponent.chunk_bytes[0] + 1, *exponent.chunk_bytes[1:]),
        data=exponent.data[: exponent.chunk_bytes[0]]
        + b"\x00"
        + exponent.data[exponent.chunk_bytes[0] :],
    )
    flipped = bytearray(exponent.data)
    flipped[30] ^= 0xFF  # inside chunk 0's Huffman streams

    with pytest.raises(LosslessFormatError, match="exponent chunk 0: 1 bytes too many"):
        decompress_tensor(
            replace(encoded, planes=replace(encoded.planes, exponent=longer))
        )
    with pytest.raises(LosslessFormatError, match="exponent chunk 0|blake3"):
        corrupt = replace(exponent, data=bytes(flipped))
        decompress_tensor(
            replace(encoded, planes=replace(encoded.planes, exponent=corrupt))
        )


def test_it_compresses_a_sharded_source_into_one_container(tmp_path, bf16_demo_folder):
    import transformers

    source = tmp_path / "sharded"
    model = transformers.LlamaForCausalLM.from_pretrained(bf16_demo_folder)
    model.save_pretrained(source, safe_serialization=True, max_shard_size="2MB")
    shards = sorted(p.name for p in source.glob("model-*.safetensors"))

    result = compress_folder(source, tmp_path / "lossless")

    names = sorted(p.name for p in (tmp_path / "lossless").iterdir())
    assert len(shards) > 1 and not set(shards) & set(names)
    assert "model.safetensors.index.json" not in names and CONTAINER_FILE in names
    assert result.tensors_blake3 == tensors_digest(read_weights(source))


@pytest.mark.parametrize("bases", [(0, 0), (3, 0), (0, 200), (255, 1)])
def test_the_merge_inverts_the_split_of_every_16_bit_word(bases):
    """Every 16-bit pattern split into planes, each plane stored minus a base (mod
    256, as the Huffman chunks store it), merged back by the compiled merge."""
    words = np.arange(1 << 16, dtype="<u2")
    exponent, rest = split_words(words)
    exponent_base, rest_base = bases
    out = np.zeros_like(words)
    merge_words(
        exponent - np.uint8(exponent_base),
        rest - np.uint8(rest_base),
        out,
        exponent_base=exponent_base,
        rest_base=rest_base,
    )
    assert np.array_equal(out, words)


def test_the_merge_refuses_planes_that_do_not_fit_the_output():
    planes = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="10 exponent bytes, 9 rest bytes"):
        merge16(planes, planes[:9], np.zeros(10, "<u2").view(np.uint8))
    with pytest.raises(ValueError, match="expected n, n and 2n"):
        merge16(planes, planes, np.zeros(9, "<u2").view(np.uint8))
    with pytest.raises(ValueError, match="bases 256 and 0 are not bytes"):
        merge16(planes, planes, np.zeros(10, "<u2").view(np.uint8), 256)
    with pytest.raises(TypeError):  # read-only output
        merge16(planes, planes, bytes(20))


def test_an_unbuilt_extension_is_named_with_how_to_build_it():
    """Without the compiled loops (a source tree never installed), importing the
    lossless coder says what is missing and how to build it."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'gpuagent.lossless._loops':\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import gpuagent.lossless.container\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "_loops.c) is not built" in done.stderr
    assert "make install" in done.stderr
