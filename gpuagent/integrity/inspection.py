"""`inspect_model`: structural checks of a model folder before anything loads it.

Every file gets a verdict and the reasons for it. Pickle-capable content is
found by content (magic bytes, ZIP end records, and pickle opcode streams parsed
as the unpickler would), not only by extension; remote code by `*.py` files and
`auto_map` in JSON configs; safetensors headers are parsed strictly by
`safetensors_header`.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuagent.integrity import _fs
from gpuagent.integrity.allowlist import (
    file_kind,
    not_allowed_detail,
    text_problem,
    tokenizer_model_problem,
)
from gpuagent.integrity.content import scan_content
from gpuagent.integrity.errors import HashingError, ModelRejectedError
from gpuagent.integrity.policy import DEFAULT_POLICY, AllowedFile, Policy
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
# Code a loader with remote code enabled (or an extension import) would run.
PYTHON_EXTENSIONS = (".py", ".pyw", ".pyc", ".pyo")
NATIVE_EXTENSIONS = (".so", ".pyd", ".dll", ".dylib")
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
    # A file's kind from allowlist.file_kind (safetensors, index, json, text,
    # tokenizer-model, signature, git, allowed; "file": not allowed), or dir,
    # symlink, special, too-deep.
    kind: str
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
            "folder": _fs.printable(self.folder),
            "ok": self.ok,
            "files": [f.to_dict() for f in self.files],
        }

    def to_text(self) -> str:
        folder = _fs.printable(self.folder)
        lines = [f"inspect {folder}: {'OK' if self.ok else 'REJECTED'}"]
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
            kind, rule = (
                file_kind(entry.path, policy)
                if entry.kind == "file"
                else (entry.kind, None)
            )
            verdict = FileVerdict(_fs.printable(entry.path), kind)
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
                header = _check_file(root_fd, entry, verdict, policy, rule)
                if header is not None:
                    headers[entry.path] = header
        indexes = [v for v in verdicts if v.kind == "index"]
        _check_indexes(indexes, headers, verdicts)
    finally:
        os.close(root_fd)
    return InspectionReport(str(folder), verdicts)


def path_kind(path: str, policy: Policy = DEFAULT_POLICY) -> str:
    """How a regular file is checked, by its name (see `allowlist.file_kind`)."""
    return file_kind(path, policy)[0]


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


def check_file_name(path: str, verdict: FileVerdict) -> None:
    """Refusals by name alone: code files, pickle-capable file types."""
    name = path.rsplit("/", 1)[-1]
    if name.lower().endswith(PYTHON_EXTENSIONS):
        verdict.reject("python-file", "Python code (remote code) is not allowed")
    if name.lower().endswith(NATIVE_EXTENSIONS):
        verdict.reject("native-code", f"{name}: a native library is not allowed")
    if name.lower().endswith(PICKLE_EXTENSIONS):
        verdict.reject("pickle-extension", f"{name}: pickle-capable file type")


def _check_file(
    root_fd: int,
    entry: _fs.Entry,
    verdict: FileVerdict,
    policy: Policy,
    rule: AllowedFile | None,
):
    if verdict.kind == "git":
        # Git's own files: never loaded, hashed or signed (the manifest leaves
        # them out), and packed history holds any old file; not read.
        return None
    check_file_name(entry.path, verdict)
    if verdict.kind == "file" and not verdict.findings:  # else refused by name
        verdict.reject("file-not-allowed", not_allowed_detail(entry.path))
    try:
        fd, size = _fs.open_file(root_fd, entry.path)
    except Exception as e:  # noqa: BLE001 - any failure is a rejection reason
        verdict.reject("unreadable", str(e))
        return None
    try:
        if verdict.kind == "safetensors":
            try:
                header = parse_header(fd, size, policy)
            except HeaderRejected as e:
                verdict.reject(e.code, e.detail)
                _check_content(fd, size, verdict, policy, False)  # what it is
                return None
            # A file that passes the strict parse is a safetensors file, and no
            # content sniffing applies to it: its first 8 bytes are the header
            # length (640 = b"\x80\x02...", a pickle protocol 2 header to a
            # sniffer; 0x8b1f... = gzip), the header is JSON text, and the data
            # buffer is tensor bytes that hold any pattern by chance ("ustar" at
            # 257, a ZIP end record near the end). Loaders pick the safetensors
            # parser by the extension, and it reads only what the checked
            # header describes; a polyglot would need a loader that opens a
            # .safetensors file as a pickle or ZIP, which none does. (Nor can
            # one run as a pickle: byte 8 is "{", no opcode, and under the
            # header limit bytes 3-7 of the length are 0-6, no opcodes either,
            # which leaves 3 bytes: too few to import and call.)
            if policy.scan_nonfinite:
                _scan_nonfinite(fd, header, verdict)
            return header
        _check_content(fd, size, verdict, policy, rule is not None and rule.containers)
        if verdict.kind in ("json", "index", "signature"):
            _check_json(fd, size, verdict, policy)
        elif verdict.kind in ("text", "tokenizer-model"):
            if size > policy.max_text_bytes:
                verdict.reject(
                    f"{verdict.kind}-too-large",
                    f"{size} bytes, more than the limit of {policy.max_text_bytes}",
                )
            else:
                check_format_bytes(_fs.read_exact_at(fd, size), verdict)
        return None
    finally:
        os.close(fd)


def check_format_bytes(data: bytes, verdict: FileVerdict) -> None:
    """The format check of a text file or tokenizer model, on its bytes."""
    if verdict.kind == "text":
        problem = text_problem(data)
    elif verdict.kind == "tokenizer-model":
        problem = tokenizer_model_problem(data)
    else:
        return
    if problem is not None:
        verdict.reject(f"{verdict.kind}-invalid", problem)


def _check_content(
    fd: int, size: int, verdict: FileVerdict, policy: Policy, allow_containers: bool
) -> None:
    """Content sniffing, whatever the file's name says (see `content`)."""
    findings = scan_content(
        _fs.FileRange(fd, size),
        max_decompressed_bytes=policy.max_decompressed_bytes,
        max_depth=policy.max_container_depth,
        max_members=policy.max_archive_members,
        allow_containers=allow_containers,
    )
    for code, detail in findings:
        verdict.reject(code, f"{detail} detected by content")


def _check_json(fd: int, size: int, verdict: FileVerdict, policy: Policy) -> Any:
    if size > policy.max_header_bytes:
        verdict.reject("json-too-large", f"{size} bytes")
        return None
    return check_json_bytes(_fs.read_exact_at(fd, size), verdict, policy)


def check_json_bytes(data: bytes, verdict: FileVerdict, policy: Policy) -> Any:
    """The strict JSON checks (and, for an index, its schema) on a JSON file's
    bytes; returns the parsed value (None when it doesn't parse)."""
    if len(data) > policy.max_header_bytes:
        verdict.reject("json-too-large", f"{len(data)} bytes")
        return None
    try:
        value = strict_json_loads(
            data.decode("utf-8"), 64, max_elements=policy.max_json_elements
        )
    except UnicodeDecodeError as e:
        verdict.reject("json-invalid", f"not UTF-8: {e}")
        return None
    except HeaderRejected as e:
        code = "json-invalid" if e.code == "invalid-json" else "json-" + e.code
        verdict.reject(code, e.detail)
        return None
    # Composite configs nest it (text_config...): search a config at any depth,
    # other JSON (a tokenizer's vocabulary is data) at the top only.
    is_config = verdict.path.rsplit("/", 1)[-1].endswith("config.json")
    where = _auto_map_path(value, nested=is_config)
    if where is not None:
        verdict.reject(
            "remote-code-auto_map",
            f"auto_map at {where} asks loaders to run code from the repo",
        )
    if verdict.kind == "index":
        _check_index_schema(value, verdict)
    verdict.parsed = value
    return value


def _auto_map_path(value: Any, path: str = "$", *, nested: bool) -> str | None:
    """Where the first `auto_map` key is in a parsed JSON value (below the top
    only when `nested`), or None (the strict parser bounds the depth)."""
    if isinstance(value, dict) and "auto_map" in value:
        return f"{path}.auto_map"
    if not nested:
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return None
    for key, child in items:
        found = _auto_map_path(child, f"{path}.{key}", nested=True)
        if found is not None:
            return found
    return None


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
