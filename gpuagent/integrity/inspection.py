"""`inspect_model`: structural checks of a model folder before anything loads it.

Every file gets a verdict and the reasons for it. Pickle-capable content is
found by magic bytes, not by extension; remote code by `*.py` files and
`auto_map` in JSON configs; safetensors headers are parsed strictly by
`safetensors_header`.
"""

from __future__ import annotations

import io
import os
import pickletools
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuagent.integrity import _fs
from gpuagent.integrity.errors import HashingError, ModelRejectedError
from gpuagent.integrity.policy import DEFAULT_POLICY, Policy
from gpuagent.integrity.safetensors_header import (
    HeaderRejected,
    SafetensorsHeader,
    parse_header,
    strict_json_loads,
)

PICKLE_EXTENSIONS = (
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".pkl",
    ".pickle",
    ".joblib",
    ".npz",
)
# (magic, offset, code, what): content that can carry a pickle or hide one.
MAGIC = [
    (b"PK\x03\x04", 0, "pickle-zip", "ZIP archive (torch .bin/.pt format)"),
    (b"PK\x05\x06", 0, "pickle-zip", "empty ZIP archive"),
    (b"7z\xbc\xaf\x27\x1c", 0, "archive-7z", "7z archive"),
    (b"\x1f\x8b", 0, "archive-gzip", "gzip stream"),
    (b"BZh", 0, "archive-other", "bzip2 stream"),
    (b"\xfd7zXZ\x00", 0, "archive-other", "xz stream"),
    (b"\x28\xb5\x2f\xfd", 0, "archive-other", "zstd stream"),
    (b"ustar", 257, "archive-other", "tar archive"),
] + [
    (b"\x89HDF\r\n\x1a\n", off, "hdf5", "HDF5 file (Keras .h5)")
    for off in (0, 512, 1024, 2048)
]
NPY_MAGIC = b"\x93NUMPY"
_HEAD_BYTES = 2048 + 8
# Bit masks of an all-ones exponent (Inf/NaN) for each float dtype, on its
# unsigned view; F8_E4M3 (fn) has no Inf and NaN is 0x7f/0xff.
_NONFINITE = {
    "F64": ("<u8", 0x7FF0000000000000, 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000, 0x7F800000),
    "F16": ("<u2", 0x7C00, 0x7C00),
    "BF16": ("<u2", 0x7F80, 0x7F80),
    "F8_E5M2": ("u1", 0x7C, 0x7C),
    "F8_E4M3": ("u1", 0x7F, 0x7F),
}


@dataclass(frozen=True)
class Finding:
    code: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "detail": self.detail}


@dataclass
class FileVerdict:
    path: str
    kind: str  # safetensors | index | json | file | dir | symlink | special | too-deep
    findings: list[Finding] = field(default_factory=list)
    parsed: Any = field(default=None, repr=False, compare=False)  # JSON content

    @property
    def verdict(self) -> str:
        return "rejected" if self.findings else "ok"

    def reject(self, code: str, detail: str) -> None:
        # Details quote names from the folder and its headers: keep them printable.
        self.findings.append(Finding(code, _fs.printable(detail)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "verdict": self.verdict,
            "reasons": [f.to_dict() for f in self.findings],
        }


@dataclass
class InspectionReport:
    folder: str
    files: list[FileVerdict]

    @property
    def ok(self) -> bool:
        return all(f.verdict == "ok" for f in self.files)

    def codes(self) -> set[str]:
        return {finding.code for f in self.files for finding in f.findings}

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "ok": self.ok,
            "files": [f.to_dict() for f in self.files],
        }

    def to_text(self) -> str:
        lines = [f"inspect {self.folder}: {'OK' if self.ok else 'REJECTED'}"]
        for f in self.files:
            lines.append(f"  {f.verdict:8} {f.kind:11} {f.path}")
            lines.extend(f"           [{x.code}] {x.detail}" for x in f.findings)
        return "\n".join(lines)


def inspect_model(
    folder: str | Path, policy: Policy = DEFAULT_POLICY
) -> InspectionReport:
    """Checks every file of `folder` without loading any weights.

    Returns the report when every file passes; raises `ModelRejectedError`
    (carrying the same report in `.report`) when any file is rejected.
    """
    report = _inspect(Path(folder), policy)
    if not report.ok:
        raise ModelRejectedError(report)
    return report


def _inspect(folder: Path, policy: Policy) -> InspectionReport:
    root_fd = _fs.open_root(folder)
    try:
        try:
            entries = _fs.scan_tree(root_fd)
        except OSError as e:
            raise HashingError(f"cannot list {folder}: {e}") from e
        verdicts: list[FileVerdict] = []
        headers: dict[str, SafetensorsHeader] = {}
        for entry in entries:
            verdict = FileVerdict(_fs.printable(entry.path), _kind(entry))
            verdicts.append(verdict)
            bad_name = _fs.bad_name_reason(entry.path)
            if bad_name is not None:
                verdict.reject("path-name-invalid", bad_name)
            elif entry.kind == "symlink":
                _check_symlink(folder, entry, verdict, policy)
            elif entry.kind == "too-deep":
                verdict.reject(
                    "folder-too-deep",
                    f"folders nested deeper than {_fs.MAX_FOLDER_DEPTH} levels",
                )
            elif entry.kind == "special":
                verdict.reject(
                    "special-file",
                    "not a regular file or folder (FIFO, socket, device)",
                )
            elif entry.kind == "file":
                header = _check_file(root_fd, entry, verdict, policy)
                if header is not None:
                    headers[entry.path] = header
        indexes = [v for v in verdicts if v.kind == "index"]
        _check_indexes(indexes, headers, verdicts)
    finally:
        os.close(root_fd)
    return InspectionReport(str(folder), verdicts)


def _kind(entry: _fs.Entry) -> str:
    if entry.kind != "file":
        return entry.kind
    if entry.path.endswith(".safetensors"):
        return "safetensors"
    if entry.path.endswith(".safetensors.index.json"):
        return "index"
    if entry.path.endswith(".json"):
        return "json"
    return "file"


def _check_symlink(
    folder: Path, entry: _fs.Entry, verdict: FileVerdict, policy: Policy
) -> None:
    target = entry.link_target or ""
    # Resolve lexically against the link's own folder: a link may point at a
    # path that does not exist yet, and must not be followed to find out.
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(entry.path), target))
    if (
        target.startswith("/")
        or resolved == ".."
        or resolved.startswith("../")
        or not _resolves_inside(folder, entry.path)
    ):
        verdict.reject("symlink-escapes", f"symlink to {target!r} leaves the folder")
    elif not policy.allow_internal_symlinks:
        verdict.reject("symlink", f"symlink to {target!r}; symlinks are not allowed")


def _resolves_inside(folder: Path, path: str) -> bool:
    """Whether `path` resolves inside `folder`. The lexical check alone is
    fooled by a link through another link: with `s -> .`, `a -> s/s/../..`
    normalizes to "." but resolves two levels above the folder. realpath only
    reads link targets; nothing is opened."""
    root = os.path.realpath(folder)
    real = os.path.realpath(os.path.join(root, path))
    return real == root or real.startswith(root.rstrip("/") + "/")


def _check_file(root_fd: int, entry: _fs.Entry, verdict: FileVerdict, policy: Policy):
    name = entry.path.rsplit("/", 1)[-1]
    if name.endswith(".py"):
        verdict.reject("python-file", "Python source (remote code) is not allowed")
    if name.lower().endswith(PICKLE_EXTENSIONS):
        verdict.reject("pickle-extension", f"{name}: pickle-capable file type")
    try:
        fd, size = _fs.open_file(root_fd, entry.path)
    except Exception as e:  # noqa: BLE001 - any failure is a rejection reason
        verdict.reject("unreadable", str(e))
        return None
    try:
        _check_magic(fd, verdict)
        if verdict.kind == "safetensors":
            try:
                header = parse_header(fd, size, policy)
            except HeaderRejected as e:
                verdict.reject(e.code, e.detail)
                return None
            if policy.scan_nonfinite:
                _scan_nonfinite(fd, header, verdict)
            return header
        if verdict.kind in ("json", "index"):
            _check_json(fd, size, verdict, policy)
        return None
    finally:
        os.close(fd)


def _check_magic(fd: int, verdict: FileVerdict) -> None:
    head = os.pread(fd, _HEAD_BYTES, 0)
    for magic, offset, code, what in MAGIC:
        if head[offset : offset + len(magic)] == magic:
            verdict.reject(code, f"{what} detected by content")
            return
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        verdict.reject(
            "pickle-protocol", f"pickle protocol {head[1]} stream detected by content"
        )
    elif head.startswith(NPY_MAGIC):
        _check_npy(fd, verdict)
    elif _is_text_pickle(head, complete=len(head) < _HEAD_BYTES):
        verdict.reject(
            "pickle-protocol", "pickle protocol 0/1 stream detected by content"
        )


# Opcodes that import or call: what makes a pickle run code when loaded.
_PICKLE_CODE_OPS = frozenset(
    {"GLOBAL", "INST", "STACK_GLOBAL", "REDUCE", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD"}
)


def _is_text_pickle(head: bytes, *, complete: bool) -> bool:
    """Protocol 0/1 pickles have no `\\x80` header. Parse the head as pickle
    opcodes (pickletools only decodes, never executes): a pickle that imports or
    calls, up to STOP or cleanly up to the end of a head cut from a longer file.
    (A lone "." is a valid STOP too, so text starting with one must not count.)
    Text and binary formats fail within a few bytes."""
    stream = io.BytesIO(head)
    code_op = False
    try:
        for opcode, _arg, _pos in pickletools.genops(stream):
            if opcode.name == "STOP":
                return code_op
            code_op = code_op or opcode.name in _PICKLE_CODE_OPS
    except Exception:  # noqa: BLE001 - any decoding error ends the parse
        return code_op and not complete and stream.tell() >= len(head)
    return False


def _check_npy(fd: int, verdict: FileVerdict) -> None:
    # numpy's own header reader uses a safe literal parser, never pickle.
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                _, _, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                _, _, dtype = np.lib.format.read_array_header_2_0(f)
        except Exception as e:  # noqa: BLE001
            verdict.reject("numpy-invalid", f"unreadable .npy header: {e}")
            return
    if dtype.hasobject:
        verdict.reject(
            "numpy-object-array", f"numpy array of dtype {dtype} holds pickles"
        )


def _check_json(fd: int, size: int, verdict: FileVerdict, policy: Policy) -> Any:
    if size > policy.max_header_bytes:
        verdict.reject("json-too-large", f"{size} bytes")
        return None
    try:
        value = strict_json_loads(_fs.read_exact_at(fd, size).decode("utf-8"), 64)
    except UnicodeDecodeError as e:
        verdict.reject("json-invalid", f"not UTF-8: {e}")
        return None
    except HeaderRejected as e:
        code = "json-invalid" if e.code == "invalid-json" else "json-" + e.code
        verdict.reject(code, e.detail)
        return None
    if isinstance(value, dict) and "auto_map" in value:
        verdict.reject(
            "remote-code-auto_map", "auto_map asks loaders to run code from the repo"
        )
    if verdict.kind == "index":
        _check_index_schema(value, verdict)
    verdict.parsed = value
    return value


def _check_index_schema(value: Any, verdict: FileVerdict) -> None:
    if not isinstance(value, dict) or not isinstance(value.get("weight_map"), dict):
        verdict.reject(
            "index-schema", "index must be an object with a weight_map object"
        )
        return
    if set(value) - {"weight_map", "metadata"}:
        verdict.reject(
            "index-schema",
            f"unknown index keys {sorted(set(value) - {'weight_map', 'metadata'})}",
        )
    for tensor, shard in value["weight_map"].items():
        if not isinstance(shard, str):
            verdict.reject("index-schema", f"{tensor}: shard name is not a string")
            return
        normal = posixpath.normpath(shard)
        if (
            shard.startswith("/")
            or "\\" in shard
            or "\x00" in shard
            or normal == ".."
            or normal.startswith("../")
            or normal != shard
        ):
            verdict.reject(
                "index-path-traversal",
                f"{tensor}: shard {shard!r} is not a plain path inside the folder",
            )
            return
        if not shard.endswith(".safetensors"):
            verdict.reject("index-shard-not-safetensors", f"{tensor}: shard {shard!r}")
            return


def _index_shards(index: FileVerdict) -> dict[str, str] | None:
    """tensor -> shard path relative to the folder, if the index parsed."""
    parsed = index.parsed
    if not isinstance(parsed, dict) or not isinstance(parsed.get("weight_map"), dict):
        return None
    base = posixpath.dirname(index.path)
    return {
        t: posixpath.join(base, s) if base else s
        for t, s in parsed["weight_map"].items()
        if isinstance(s, str)
    }


def _check_indexes(
    indexes: list[FileVerdict],
    headers: dict[str, SafetensorsHeader],
    verdicts: list[FileVerdict],
) -> None:
    """Each index names shards inside the folder, each tensor is in the shard it
    is mapped to, and no safetensors file is left out of every index."""
    by_path = {v.path: v for v in verdicts}
    referenced: set[str] = set()
    for index in indexes:
        weight_map = _index_shards(index)
        if weight_map is None:
            continue
        shards = set(weight_map.values())
        referenced |= shards
        if index.findings:
            continue
        for shard in sorted(shards):
            if shard not in by_path or by_path[shard].kind != "safetensors":
                index.reject(
                    "index-missing-shard",
                    f"shard {shard} is not a safetensors file in the folder",
                )
        owner: dict[str, str] = {}
        for shard in sorted(shards & set(headers)):
            for tensor in headers[shard].tensors:
                if tensor in owner:
                    index.reject(
                        "index-duplicate-tensor",
                        f"{tensor} is in {owner[tensor]} and {shard}",
                    )
                owner[tensor] = shard
        for tensor, shard in sorted(weight_map.items()):
            if shard in headers and tensor not in headers[shard].tensors:
                found = owner.get(tensor)
                where = f"; it is in {found}" if found else ""
                index.reject(
                    "index-tensor-missing",
                    f"{tensor} is mapped to {shard} but not in it{where}",
                )
        for tensor, shard in sorted(owner.items()):
            if tensor not in weight_map:
                index.reject(
                    "index-unmapped-tensor", f"{tensor} in {shard} is not in weight_map"
                )
    if indexes:
        for shard in sorted(set(headers) - referenced):
            by_path[shard].reject(
                "index-unreferenced-shard", "safetensors file not named by any index"
            )


def _scan_nonfinite(fd: int, header: SafetensorsHeader, verdict: FileVerdict) -> None:
    chunk_bytes = 16 << 20
    for tensor in header.tensors.values():
        spec = _NONFINITE.get(tensor.dtype)
        if spec is None or tensor.end == tensor.begin:
            continue
        view, mask, nonfinite = spec
        itemsize = np.dtype(view).itemsize
        step = chunk_bytes - chunk_bytes % itemsize
        count = 0
        for start in range(tensor.begin, tensor.end, step):
            length = min(step, tensor.end - start)
            raw = os.pread(fd, length, header.data_start + start)
            values = np.frombuffer(raw, dtype=view)
            count += int(np.count_nonzero((values & mask) == nonfinite))
        if count:
            verdict.reject(
                "nonfinite-weights", f"{tensor.name}: {count} NaN/Inf value(s)"
            )
