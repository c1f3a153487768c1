"""Lossless compression of float checkpoints for storage and distribution.

Each bf16/fp16/fp32 tensor is split into an exponent plane, Huffman-coded, and a
sign+mantissa plane stored raw (see `planes`); decoding gives the original
bits, every NaN payload and subnormal included.

The container, `model.lossless.safetensors`, is a plain safetensors file, so the
integrity manifest hashes it like any other file and the gate parses its header
strictly. It holds two U8 tensors per original tensor, `<name>:exponent` and
`<name>:rest`, and under `__metadata__["releasegate.lossless"]` a JSON header:

    {"format": "releasegate.lossless", "version": 1, "chunk_elements": 262144,
     "tensors": {"<name>": {"dtype": "BF16", "shape": [576, 1536],
                            "exponent": {"codecs": "hh..", "chunk_bytes": [..]},
                            "rest": {"codecs": "rr..", "chunk_bytes": [..]},
                            "blake3": "<digest of the decoded tensor bytes>"}},
     "tensors_blake3": "<tensors_digest of all decoded tensors>"}

Reading checks every field (types, bounds, no unknown keys, sizes that add up, each
chunk decoding to exactly its size) before and while decoding, then each decoded
tensor against its recorded digest: the manifest covers the compressed bytes, the
digests the decompressed ones. Nothing in the file is executed.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from safetensors.numpy import save as save_numpy_safetensors
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_torch_safetensors

from gpuagent.integrity.policy import DEFAULT_POLICY
from gpuagent.integrity.safetensors_header import HeaderRejected, parse_header_bytes
from gpuagent.integrity.strict_json import Rejected, strict_json_loads
from gpuagent.lossless.planes import (
    DEFAULT_CHUNK_ELEMENTS,
    MAX_CHUNK_ELEMENTS,
    WORD_TYPES,
    CodedPlane,
    CodedWords,
    PlaneDecodeError,
    check_plane,
    decode_words,
    default_threads,
    encode_words,
)

FORMAT = "releasegate.lossless"
VERSION = 1
METADATA_KEY = FORMAT
CONTAINER_FILE = "model.lossless.safetensors"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
HEADER_FIELDS = frozenset(
    {"format", "version", "chunk_elements", "tensors", "tensors_blake3"}
)
TENSOR_FIELDS = frozenset({"dtype", "shape", "exponent", "rest", "blake3"})
PLANE_FIELDS = frozenset({"codecs", "chunk_bytes"})
PLANES = ("exponent", "rest")
MAX_RANK = 8
MAX_JSON_DEPTH = 8
# What one container may decode to unless the caller allows more: a bound on the
# memory a hostile header can make the reader allocate.
DEFAULT_MAX_DECODED_BYTES = 64 << 30
_HEX_DIGITS = frozenset("0123456789abcdef")


class LosslessFormatError(ValueError):
    """The container is not a valid lossless checkpoint; the message says why."""


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor, coded: what the container stores for it."""

    dtype: str  # safetensors name: BF16, F16 or F32
    shape: tuple[int, ...]
    chunk_elements: int
    planes: CodedWords
    blake3: str  # hex digest of the decoded (original) tensor bytes

    @property
    def original_bytes(self) -> int:
        return math.prod(self.shape) * WORD_TYPES[self.dtype].itemsize

    @property
    def compressed_bytes(self) -> int:
        return len(self.planes.exponent.data) + len(self.planes.rest.data)


@dataclass(frozen=True)
class LosslessFolderResult:
    """What `compress_folder` wrote."""

    out_dir: Path
    tensors: int
    original_bytes: int  # of the float tensors' data
    compressed_bytes: int  # of the container file
    tensors_blake3: str  # `tensors_digest` of the source tensors

    @property
    def ratio(self) -> float:
        return self.compressed_bytes / self.original_bytes if self.original_bytes else 1


# --- per tensor ------------------------------------------------------------------


def compress_tensor(
    tensor: torch.Tensor,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    pool: concurrent.futures.Executor | None = None,
) -> EncodedTensor:
    """Code one bf16/fp16/fp32 CPU tensor; raises LosslessFormatError for others."""
    words = _words(tensor)
    _check_chunk_elements(chunk_elements)
    return EncodedTensor(
        dtype=DTYPE_NAMES[tensor.dtype],
        shape=tuple(tensor.shape),
        chunk_elements=chunk_elements,
        planes=encode_words(words, chunk_elements=chunk_elements, pool=pool),
        blake3=blake3.blake3(words.view(np.uint8)).hexdigest(),
    )


def decompress_tensor(
    encoded: EncodedTensor, *, threads: int = 1, verify: bool = True
) -> torch.Tensor:
    """The original tensor, bit for bit; with `verify`, checked against its digest
    (LosslessFormatError on any mismatch or malformed plane)."""
    return decode_tensors({"tensor": encoded}, threads=threads, verify=verify)["tensor"]


def decode_tensors(
    encoded: Mapping[str, EncodedTensor], *, threads: int = 1, verify: bool = True
) -> dict[str, torch.Tensor]:
    """`decompress_tensor` for many tensors at once, their chunks spread over
    `threads` threads."""
    items = []
    try:
        for name, e in encoded.items():
            _check_planes(e)
            words = np.empty(math.prod(e.shape), dtype=WORD_TYPES[e.dtype])
            items.append((name, e.planes, words))
        chunk_sizes = {e.chunk_elements for e in encoded.values()}
        for chunk_elements in chunk_sizes:
            decode_words(
                [i for i in items if encoded[i[0]].chunk_elements == chunk_elements],
                chunk_elements=chunk_elements,
                threads=threads,
            )
    except PlaneDecodeError as exc:
        raise LosslessFormatError(str(exc)) from exc
    tensors = {}
    for name, _, words in items:
        e = encoded[name]
        if (
            verify
            and blake3.blake3(words.view(np.uint8), max_threads=threads).hexdigest()
            != e.blake3
        ):
            raise LosslessFormatError(
                f"{name}: decoded bytes do not match the recorded blake3 digest"
            )
        signed = words.view({2: np.int16, 4: np.int32}[words.dtype.itemsize])
        tensors[name] = torch.from_numpy(signed).view(TORCH_DTYPES[e.dtype])
        tensors[name] = tensors[name].reshape(e.shape)
    return tensors


def _check_planes(encoded: EncodedTensor) -> None:
    _check_chunk_elements(encoded.chunk_elements)
    for name in PLANES:
        plane: CodedPlane = getattr(encoded.planes, name)
        check_plane(
            plane.codecs,
            list(plane.chunk_bytes),
            count=math.prod(encoded.shape),
            chunk_elements=encoded.chunk_elements,
            bytes_per_element=_plane_bytes_per_element(encoded.dtype, name),
        )
        if sum(plane.chunk_bytes) != len(plane.data):
            raise PlaneDecodeError(
                f"chunk sizes add up to {sum(plane.chunk_bytes)}, "
                f"plane holds {len(plane.data)} bytes"
            )


def _plane_bytes_per_element(dtype: str, plane: str) -> int:
    return 1 if plane == "exponent" else WORD_TYPES[dtype].itemsize - 1


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """blake3 hex over every tensor's name, dtype, shape and bytes, in name order:
    equal for a checkpoint and its decoded container, whatever the file layout."""
    listing = [
        [name, str(t.dtype), list(t.shape), _tensor_blake3(t)]
        for name, t in sorted(tensors.items())
    ]
    return blake3.blake3(json.dumps(listing).encode()).hexdigest()


def _listing_digest(encoded: Mapping[str, EncodedTensor]) -> str:
    listing = [
        [name, str(TORCH_DTYPES[e.dtype]), list(e.shape), e.blake3]
        for name, e in sorted(encoded.items())
    ]
    return blake3.blake3(json.dumps(listing).encode()).hexdigest()


def _tensor_blake3(tensor: torch.Tensor) -> str:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return blake3.blake3(flat.view(torch.uint8).numpy()).hexdigest()


def _words(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype not in DTYPE_NAMES:
        raise LosslessFormatError(
            f"dtype {tensor.dtype} is not coded losslessly (bf16, fp16, fp32 are)"
        )
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    signed = flat.view({2: torch.int16, 4: torch.int32}[flat.element_size()])
    return signed.numpy().view(WORD_TYPES[DTYPE_NAMES[tensor.dtype]])


def _check_chunk_elements(chunk_elements: int) -> None:
    if not _is_int(chunk_elements) or not 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS:
        raise LosslessFormatError(
            f"chunk_elements {chunk_elements!r} is not in 1..{MAX_CHUNK_ELEMENTS}"
        )


# --- container ---------------------------------------------------------------------


def encode_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    threads: int | None = None,
) -> bytes:
    """The container file's bytes for `tensors` (name -> bf16/fp16/fp32 tensor)."""
    _check_chunk_elements(chunk_elements)
    bad = [n for n in tensors if not n or ":" in n]
    if bad:
        raise LosslessFormatError(f"tensor names empty or holding ':': {bad}")
    bad = {n: str(t.dtype) for n, t in tensors.items() if t.dtype not in DTYPE_NAMES}
    if bad:
        raise LosslessFormatError(
            f"tensors not coded losslessly (bf16, fp16, fp32 are): {bad}"
        )
    with thread_pool(threads) as pool:
        encoded = {
            name: compress_tensor(t, chunk_elements=chunk_elements, pool=pool)
            for name, t in sorted(tensors.items())
        }
    header = {
        "format": FORMAT,
        "version": VERSION,
        "chunk_elements": chunk_elements,
        "tensors": {
            name: {
                "dtype": e.dtype,
                "shape": list(e.shape),
                **{
                    plane: {
                        "codecs": getattr(e.planes, plane).codecs,
                        "chunk_bytes": list(getattr(e.planes, plane).chunk_bytes),
                    }
                    for plane in PLANES
                },
                "blake3": e.blake3,
            }
            for name, e in encoded.items()
        },
        "tensors_blake3": tensors_digest(tensors),
    }
    arrays = {
        f"{name}:{plane}": np.frombuffer(getattr(e.planes, plane).data, np.uint8)
        for name, e in encoded.items()
        for plane in PLANES
    }
    return save_numpy_safetensors(
        arrays, metadata={METADATA_KEY: json.dumps(header, separators=(",", ":"))}
    )


@dataclass(frozen=True)
class Container:
    """A parsed, validated container, not yet decoded."""

    tensors: dict[str, EncodedTensor]
    tensors_blake3: str


def read_container(
    data: bytes, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES
) -> Container:
    """Parse and validate a container (no decoding yet: planes are views of
    `data`); LosslessFormatError names the first problem found."""
    try:
        parsed = parse_header_bytes(data, DEFAULT_POLICY)
    except HeaderRejected as exc:
        raise LosslessFormatError(f"not a valid safetensors file: {exc}") from exc
    text = parsed.metadata.get(METADATA_KEY)
    if text is None:
        raise LosslessFormatError(f"no {METADATA_KEY!r} header in __metadata__")
    unknown_metadata = sorted(set(parsed.metadata) - {METADATA_KEY})
    if unknown_metadata:
        raise LosslessFormatError(f"unknown __metadata__ keys {unknown_metadata}")
    try:
        header = strict_json_loads(text, MAX_JSON_DEPTH)
    except Rejected as exc:
        raise LosslessFormatError(f"header is not valid JSON: {exc}") from exc
    _check_fields("header", header, HEADER_FIELDS)
    if header["format"] != FORMAT or header["version"] != VERSION:
        raise LosslessFormatError(
            f"format {header['format']!r} version {header['version']!r}; "
            f"this reader reads {FORMAT!r} version {VERSION}"
        )
    chunk_elements = header["chunk_elements"]
    try:
        _check_chunk_elements(chunk_elements)
    except LosslessFormatError as exc:
        raise LosslessFormatError(f"header: {exc}") from exc
    _check_hex("header: tensors_blake3", header["tensors_blake3"])
    described = header["tensors"]
    if not isinstance(described, dict):
        raise LosslessFormatError("header: tensors is not an object")
    expected_names = {f"{n}:{p}" for n in described for p in PLANES}
    stored = set(parsed.tensors)
    if stored != expected_names:
        raise LosslessFormatError(
            f"stored planes do not match the header: missing "
            f"{sorted(expected_names - stored)}, unexpected "
            f"{sorted(stored - expected_names)}"
        )
    view = memoryview(data)
    encoded: dict[str, EncodedTensor] = {}
    decoded_bytes = 0
    for name, entry in described.items():
        tensor = _read_tensor_entry(name, entry, chunk_elements)
        planes = {}
        for plane in PLANES:
            stored_plane = parsed.tensors[f"{name}:{plane}"]
            if stored_plane.dtype != "U8" or len(stored_plane.shape) != 1:
                raise LosslessFormatError(
                    f"{name}:{plane}: stored as {stored_plane.dtype} "
                    f"{list(stored_plane.shape)}, not a 1-D U8 array"
                )
            codecs, chunk_bytes = entry[plane]["codecs"], entry[plane]["chunk_bytes"]
            if sum(chunk_bytes) != stored_plane.end - stored_plane.begin:
                raise LosslessFormatError(
                    f"{name}:{plane}: chunk sizes add up to {sum(chunk_bytes)}, "
                    f"{stored_plane.end - stored_plane.begin} bytes stored"
                )
            begin = parsed.data_start + stored_plane.begin
            planes[plane] = CodedPlane(
                codecs,
                tuple(chunk_bytes),
                view[begin : parsed.data_start + stored_plane.end],
            )
        tensor = EncodedTensor(
            tensor.dtype,
            tensor.shape,
            chunk_elements,
            CodedWords(planes["exponent"], planes["rest"]),
            tensor.blake3,
        )
        decoded_bytes += tensor.original_bytes
        if decoded_bytes > max_decoded_bytes:
            raise LosslessFormatError(
                f"decodes to more than max_decoded_bytes={max_decoded_bytes}"
            )
        encoded[name] = tensor
    return Container(encoded, header["tensors_blake3"])


def decode_checkpoint(
    data: bytes,
    *,
    threads: int | None = None,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> dict[str, torch.Tensor]:
    """All tensors of a container, bit-exact, each checked against its recorded
    digest and the whole against the recorded `tensors_blake3`."""
    container = read_container(data, max_decoded_bytes=max_decoded_bytes)
    tensors = decode_tensors(container.tensors, threads=threads or default_threads())
    # The per-tensor digests were just checked: the listing reuses them.
    if _listing_digest(container.tensors) != container.tensors_blake3:
        raise LosslessFormatError("decoded tensors do not match tensors_blake3")
    return tensors


def _read_tensor_entry(name: str, entry: Any, chunk_elements: int) -> EncodedTensor:
    where = f"header: tensor {name!r}"
    if not name or ":" in name:
        raise LosslessFormatError(f"{where}: name empty or holding ':'")
    _check_fields(where, entry, TENSOR_FIELDS)
    dtype, shape = entry["dtype"], entry["shape"]
    if dtype not in WORD_TYPES:
        raise LosslessFormatError(f"{where}: dtype {dtype!r} not in {list(WORD_TYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(_is_int(d) and 0 <= d < 2**40 for d in shape)
    ):
        raise LosslessFormatError(f"{where}: shape {shape!r} is not a valid shape")
    _check_hex(f"{where}: blake3", entry["blake3"])
    for plane in PLANES:
        _check_fields(f"{where} {plane}", entry[plane], PLANE_FIELDS)
        codecs, chunk_bytes = entry[plane]["codecs"], entry[plane]["chunk_bytes"]
        if not isinstance(codecs, str) or not isinstance(chunk_bytes, list):
            raise LosslessFormatError(f"{where} {plane}: codecs/chunk_bytes mistyped")
        if not all(_is_int(s) and s >= 0 for s in chunk_bytes):
            raise LosslessFormatError(
                f"{where} {plane}: chunk_bytes are not non-negative integers"
            )
        try:
            check_plane(
                codecs,
                chunk_bytes,
                count=math.prod(shape),
                chunk_elements=chunk_elements,
                bytes_per_element=_plane_bytes_per_element(dtype, plane),
            )
        except PlaneDecodeError as exc:
            raise LosslessFormatError(f"{where} {plane}: {exc}") from exc
    empty = CodedPlane("", (), b"")
    return EncodedTensor(
        dtype, tuple(shape), chunk_elements, CodedWords(empty, empty), entry["blake3"]
    )


def _check_fields(where: str, value: Any, fields: frozenset[str]) -> None:
    if not isinstance(value, dict):
        raise LosslessFormatError(f"{where} is not an object")
    if set(value) != fields:
        raise LosslessFormatError(
            f"{where}: unknown fields {sorted(set(value) - fields)}, "
            f"missing fields {sorted(fields - set(value))}"
        )


def _check_hex(where: str, value: Any) -> None:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX_DIGITS:
        raise LosslessFormatError(f"{where} is not a 64-digit lowercase hex digest")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def thread_pool(threads: int | None) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=threads or default_threads()
    )


# --- folders -------------------------------------------------------------------------


def compress_folder(
    src: str | Path,
    out: str | Path,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    threads: int | None = None,
) -> LosslessFolderResult:
    """Write `out`: `src` with its safetensors weights (one file or shards and
    their index) replaced by `model.lossless.safetensors`, every other file
    copied. `src` must pass integrity inspection; `out` must not exist. Written to
    a temporary folder renamed into place when complete."""
    from gpuagent.integrity.inspection import inspect_model

    src, out = Path(src), Path(out)
    inspect_model(src)
    if (src / CONTAINER_FILE).exists():
        raise LosslessFormatError(f"{src} already holds {CONTAINER_FILE}")
    weight_files = _weight_files(src)
    tensors = read_weights(src)
    container = encode_checkpoint(
        tensors, chunk_elements=chunk_elements, threads=threads
    )
    _write_folder(src, out, set(weight_files), {CONTAINER_FILE: container})
    return LosslessFolderResult(
        out_dir=out,
        tensors=len(tensors),
        original_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        compressed_bytes=len(container),
        tensors_blake3=tensors_digest(tensors),
    )


def decompress_folder(
    src: str | Path, out: str | Path, *, threads: int | None = None
) -> Path:
    """Write `out`: `src` with its container decoded back into `model.safetensors`
    (the same tensors bit for bit; the file's header layout is safetensors'
    own), every other file copied. `out` must not exist."""
    src, out = Path(src), Path(out)
    container = src / CONTAINER_FILE
    if not container.is_file():
        raise LosslessFormatError(f"{container} not found")
    tensors = decode_checkpoint(container.read_bytes(), threads=threads)
    weights = save_torch_safetensors(tensors, metadata={"format": "pt"})
    _write_folder(src, out, {CONTAINER_FILE}, {WEIGHTS_FILE: weights})
    return out


def read_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's `model.safetensors`, or of the shards its
    index names (parsed by safetensors from the bytes, never unpickled)."""
    tensors: dict[str, torch.Tensor] = {}
    for name in _weight_files(Path(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(
                load_safetensors_bytes((Path(model_dir) / name).read_bytes())
            )
    return tensors


def _weight_files(src: Path) -> list[str]:
    if (src / INDEX_FILE).is_file():
        index = json.loads((src / INDEX_FILE).read_text())
        return [INDEX_FILE, *sorted(set(index["weight_map"].values()))]
    if (src / WEIGHTS_FILE).is_file():
        return [WEIGHTS_FILE]
    raise LosslessFormatError(f"{src} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def _write_folder(
    src: Path, out: Path, skip: set[str], new_files: Mapping[str, bytes]
) -> None:
    if out.exists():
        raise LosslessFormatError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for path in sorted(src.rglob("*")):
            relative = path.relative_to(src).as_posix()
            if relative in skip or path.is_dir():
                continue
            target = staging / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target, follow_symlinks=False)
        for name, data in new_files.items():
            (staging / name).write_bytes(data)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
