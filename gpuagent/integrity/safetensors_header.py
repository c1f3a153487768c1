"""Strict parsing of a safetensors header, done here rather than trusting the
`safetensors` library, which accepts duplicate tensor names (last wins), a
header not starting with `{` and unknown fields in an entry.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON starting
with `{` (space padding allowed after it), then the data buffer, which the
tensors must tile exactly.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuagent.integrity.policy import DEFAULT_POLICY, SAFETENSORS_DTYPE_SIZES, Policy
from gpuagent.integrity.strict_json import Rejected as HeaderRejected
from gpuagent.integrity.strict_json import strict_json_loads

ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_MAX_INT64 = 2**63 - 1


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data buffer
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    header_bytes: int  # N
    data_start: int  # 8 + N, absolute offset of the data buffer
    data_bytes: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(
    fd: int, file_size: int, policy: Policy = DEFAULT_POLICY
) -> SafetensorsHeader:
    """Reads only the first 8 + N bytes of the file behind `fd` and validates
    the whole header against `file_size`. Raises HeaderRejected."""
    return _parse(lambda size, offset: os.pread(fd, size, offset), file_size, policy)


def parse_header_bytes(
    data: bytes, policy: Policy = DEFAULT_POLICY
) -> SafetensorsHeader:
    """`parse_header` on a whole file already in memory. Raises HeaderRejected."""
    view = memoryview(data)
    return _parse(
        lambda size, offset: bytes(view[offset : offset + size]), len(data), policy
    )


def _parse(
    read_at: Callable[[int, int], bytes], file_size: int, policy: Policy
) -> SafetensorsHeader:
    if file_size < 8:
        raise HeaderRejected("file-too-short", f"{file_size} bytes, need at least 8")
    prefix = read_at(8, 0)
    if len(prefix) != 8:
        raise HeaderRejected("file-too-short", "could not read the 8-byte length")
    (n,) = struct.unpack("<Q", prefix)
    if n > policy.max_header_bytes:
        raise HeaderRejected(
            "header-too-large", f"header length {n} > limit {policy.max_header_bytes}"
        )
    if n > file_size - 8:
        raise HeaderRejected(
            "header-past-end", f"header length {n} > file size - 8 ({file_size - 8})"
        )
    if n == 0:
        raise HeaderRejected("header-not-object", "empty header")
    raw = read_at(n, 8)
    if len(raw) != n:
        raise HeaderRejected("header-past-end", "file shorter than its header length")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderRejected("header-not-utf8", str(e)) from e
    if not text.startswith("{"):
        raise HeaderRejected(
            "header-not-object", f"header starts with {text[:1]!r}, not '{{'"
        )
    header = strict_json_loads(
        text,
        policy.max_json_depth,
        safetensors_header=True,
        max_elements=policy.max_json_elements,
    )
    if not isinstance(header, dict):
        raise HeaderRejected("header-not-object", "header is not a JSON object")

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderRejected("metadata-not-str-map", "__metadata__ must map str to str")

    data_start = 8 + n
    data_bytes = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        tensors[name] = _check_entry(name, entry, policy)
    _check_tiling(list(tensors.values()), data_bytes)
    return SafetensorsHeader(n, data_start, data_bytes, metadata, tensors)


def _check_entry(name: str, entry: Any, policy: Policy) -> TensorEntry:
    if not name:
        raise HeaderRejected("tensor-name-invalid", "empty tensor name")
    if not isinstance(entry, dict):
        raise HeaderRejected("entry-not-object", f"{name}: entry is not an object")
    if set(entry) != ENTRY_FIELDS:
        unknown = sorted(set(entry) - ENTRY_FIELDS)
        missing = sorted(ENTRY_FIELDS - set(entry))
        raise HeaderRejected(
            "entry-fields",
            f"{name}: unknown fields {unknown}, missing fields {missing}",
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in policy.allowed_dtypes:
        raise HeaderRejected(
            "dtype-not-allowed", f"{name}: dtype {dtype!r} not allowed"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > policy.max_tensor_rank
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise HeaderRejected(
            "shape-invalid",
            f"{name}: shape {shape!r} is not a list of non-negative ints",
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderRejected(
            "offsets-invalid", f"{name}: data_offsets {offsets!r} invalid"
        )
    # Every running product must fit an int64 even when a later dim is 0: the
    # Rust parser and torch refuse such shapes, so the gate must not pass them.
    running = SAFETENSORS_DTYPE_SIZES[dtype]
    for dim in shape:
        running *= dim
        if running > _MAX_INT64 or dim > _MAX_INT64:
            raise HeaderRejected(
                "shape-overflow", f"{name}: shape {shape!r} overflows 64-bit sizes"
            )
    expected = math.prod(shape) * SAFETENSORS_DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise HeaderRejected(
            "size-mismatch",
            f"{name}: {offsets[1] - offsets[0]} bytes for shape {shape} {dtype}, "
            f"{expected} expected",
        )
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_tiling(entries: list[TensorEntry], data_bytes: int) -> None:
    position = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.end > data_bytes:
            raise HeaderRejected(
                "data-past-end",
                f"{entry.name}: ends at {entry.end} > buffer {data_bytes}",
            )
        if entry.begin > position:
            raise HeaderRejected(
                "data-gap", f"gap of {entry.begin - position} bytes before {entry.name}"
            )
        if entry.begin < position:
            raise HeaderRejected(
                "data-overlap", f"{entry.name} overlaps the previous tensor"
            )
        position = entry.end
    if position != data_bytes:
        raise HeaderRejected(
            "trailing-bytes", f"{data_bytes - position} bytes after the last tensor"
        )
