"""`inspect_model`: structural checks of a model folder before anything loads it.

Every file gets a verdict and the reasons for it. What can be refused without
reading is refused first: names and the folder's limits (`limits`), file names
(`allowlist`), sizes, holes (a sparse file); a file refused so is never read.
Pickle-capable content is found by content (magic bytes, ZIP end records, and
pickle opcode streams parsed as the unpickler would), not only by extension;
remote code by `*.py` files and `auto_map` in JSON configs; safetensors headers
are parsed strictly by `safetensors_header`; every index's shards must be
safetensors files of the folder that a signature covers.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
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
from gpuagent.integrity.manifest import Manifest
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
# Where a folder refused only for its code can go (the engine's model types).
IMPORT_HINT = (
    "a published Kimi K2 / DeepSeek-V3 / GLM-4.5 / Llama folder can be imported "
    "without it: python -m gpuagent.models.import_published SRC DST"
)
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
    # tokenizer-model, signature, allowed; "file": not allowed), or dir,
    # symlink, special, folder (a limit of the whole folder).
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
            entries = _fs.scan_tree(
                root_fd, policy.limits, prefix=_fs.prefix_bytes(folder)
            )
        except OSError as e:
            raise HashingError(f"cannot list {folder}: {e}") from e
        verdicts: list[FileVerdict] = []
        headers: dict[str, SafetensorsHeader] = {}
        for entry in entries:
            kind, rule = (
                file_kind(entry.path, policy)
                if entry.kind == "file" and entry.problem is None
                else (entry.kind, None)
            )
            verdict = FileVerdict(_fs.printable(entry.path), kind)
            verdicts.append(verdict)
            if entry.problem is not None:  # by name or a limit: not read
                verdict.reject(*entry.problem)
            elif entry.kind == "symlink":
                _check_symlink(folder, entry, verdict, policy)
            elif entry.kind == "special":
                verdict.reject(
                    "special-file",
                    "not a regular file or folder (FIFO, socket, device)",
                )
            elif entry.kind == "file":
                header = _check_file(root_fd, entry, verdict, policy, rule)
                if header is not None:
                    headers[entry.path] = header
        _check_indexes(verdicts, headers, sorted(policy.ignorable_paths()))
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
    """Refusals by name alone: code files, pickle-capable file types, and
    (kind "file") any other name the allow-list does not admit."""
    name = path.rsplit("/", 1)[-1]
    if name.lower().endswith(PYTHON_EXTENSIONS):
        verdict.reject(
            "python-file", f"Python code (remote code) is not allowed; {IMPORT_HINT}"
        )
    if name.lower().endswith(NATIVE_EXTENSIONS):
        verdict.reject("native-code", f"{name}: a native library is not allowed")
    if name.lower().endswith(PICKLE_EXTENSIONS):
        verdict.reject("pickle-extension", f"{name}: pickle-capable file type")
    if verdict.kind == "file" and not verdict.findings:
        verdict.reject("file-not-allowed", not_allowed_detail(path))


def check_file_size(size: int, verdict: FileVerdict, policy: Policy) -> None:
    """Refusals by size alone, for the kinds read whole (JSON, the signature,
    text, tokenizer models): checked before reading them."""
    if verdict.kind in ("json", "index", "signature"):
        code = "json-too-large"
        limit = (
            policy.limits.max_signature_bytes
            if verdict.kind == "signature"
            else policy.max_header_bytes
        )
    elif verdict.kind in ("text", "tokenizer-model"):
        code, limit = f"{verdict.kind}-too-large", policy.max_text_bytes
    else:
        return
    if size > limit:
        verdict.reject(code, f"{size} bytes, more than the limit of {limit}")


def _check_file(
    root_fd: int,
    entry: _fs.Entry,
    verdict: FileVerdict,
    policy: Policy,
    rule: AllowedFile | None,
):
    check_file_name(entry.path, verdict)
    if verdict.findings:  # refused by name: never opened, never read
        return None
    try:
        fd, size = _fs.open_file(root_fd, entry.path)
    except Exception as e:  # noqa: BLE001 - any failure is a rejection reason
        verdict.reject("unreadable", str(e))
        return None
    try:
        # Size and holes from the open file, before reading any of it.
        check_file_size(size, verdict, policy)
        hole = None if verdict.findings else _fs.first_hole(fd, size)
        if hole is not None:
            verdict.reject("sparse-file", _fs.sparse_detail(hole, size))
        if verdict.findings:
            return None
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
            check_json_bytes(_fs.read_exact_at(fd, size), verdict, policy)
        elif verdict.kind in ("text", "tokenizer-model"):
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


def check_json_bytes(data: bytes, verdict: FileVerdict, policy: Policy) -> Any:
    """The strict JSON checks (and, for an index, its schema) on a JSON file's
    bytes; returns the parsed value (None when it doesn't parse)."""
    check_file_size(len(data), verdict, policy)
    if verdict.findings:
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
            f"auto_map at {where} asks loaders to run code from the repo; "
            + IMPORT_HINT,
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
    bad: dict[str, dict[str, str]] = {}  # code -> shard -> a tensor mapped to it
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
            bad.setdefault("index-path-traversal", {}).setdefault(shard, tensor)
        elif not shard.endswith(".safetensors"):
            bad.setdefault("index-shard-not-safetensors", {}).setdefault(shard, tensor)
    what = {
        "index-path-traversal": "not a plain path inside the folder",
        "index-shard-not-safetensors": "not a .safetensors file",
    }
    for code, shards in bad.items():
        named = [f"{shard!r} (for {tensor})" for shard, tensor in shards.items()]
        verdict.reject(code, f"shard {_some(named)}: {what[code]}")


def _some(items: list[str], shown: int = 10) -> str:
    """The first `shown` items, and how many more."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


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


def check_index_references(
    index: FileVerdict, kinds: Mapping[str, str], ignored: Sequence[str]
) -> None:
    """Every shard the parsed `index` names (its schema passed) must be a
    safetensors file of the folder (`kinds`: path -> kind of what is there)
    outside `ignored`, the paths a signature leaves out: a loader follows an
    index, so a shard there would load weights nothing verified."""
    weight_map = _index_shards(index)
    if weight_map is None or index.findings:
        return
    unsigned, missing, other = [], [], []
    for shard in sorted(set(weight_map.values())):
        kind = kinds.get(shard)
        if _fs.is_ignored(shard, ignored):
            unsigned.append(shard)
        elif kind is None:
            missing.append(shard)
        elif kind != "safetensors":
            other.append(f"{shard} (a {kind})")
    if unsigned:
        index.reject(
            "index-shard-not-signed",
            f"shard {_some(unsigned)}: under a path a signature leaves out "
            f"({', '.join(ignored)}), so its weights would load unverified",
        )
    if missing:
        index.reject(
            "index-missing-shard", f"shard {_some(missing)}: not a file in the folder"
        )
    if other:
        index.reject(
            "index-missing-shard", f"shard {_some(other)}: not a safetensors file"
        )


def _check_indexes(
    verdicts: list[FileVerdict],
    headers: dict[str, SafetensorsHeader],
    ignored: Sequence[str],
) -> None:
    """Each index names shards of the folder that a signature covers, each
    tensor is in the shard it is mapped to, and no safetensors file is left out
    of every index."""
    by_path = {v.path: v for v in verdicts}
    kinds = {v.path: v.kind for v in verdicts}
    indexes = [v for v in verdicts if v.kind == "index"]
    referenced: set[str] = set()
    for index in indexes:
        weight_map = _index_shards(index)
        if weight_map is None:
            continue
        shards = set(weight_map.values())
        referenced |= shards
        if index.findings:
            continue
        check_index_references(index, kinds, ignored)
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


def check_signed_indexes(
    folder: str | Path, manifest: Manifest, policy: Policy
) -> None:
    """The index checks of `inspect_model` for what a signature covers: every
    index among the files of `manifest` (read from `folder`, bounded: JSON) names
    only shards the manifest covers (`check_index_references`). For `sign_model`
    and `verify_model`, which do not inspect; raises ModelRejectedError naming
    each bad index and shard."""
    kinds = {path: path_kind(path, policy) for path in manifest.files()}
    verdicts = []
    root_fd = _fs.open_root(folder)
    try:
        for path in sorted(p for p, kind in kinds.items() if kind == "index"):
            verdict = FileVerdict(_fs.printable(path), "index")
            verdicts.append(verdict)
            fd, size = _fs.open_file(root_fd, path)
            try:
                check_file_size(size, verdict, policy)
                if not verdict.findings:
                    check_json_bytes(_fs.read_exact_at(fd, size), verdict, policy)
            finally:
                os.close(fd)
            check_index_references(verdict, kinds, manifest.ignore_paths)
    finally:
        os.close(root_fd)
    report = InspectionReport(str(folder), verdicts)
    if not report.ok:
        raise ModelRejectedError(report)


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
