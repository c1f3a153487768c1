"""`inspect_model`: structural checks of a model folder before anything loads it.

Every file gets a verdict and the reasons for it. Pickle-capable content is
found by content (magic bytes, ZIP end records, and pickle opcode streams parsed
as the unpickler would), not only by extension; remote code by `*.py` files and
`auto_map` in JSON configs; safetensors headers are parsed strictly by
`safetensors_header`.
"""

from __future__ import annotations

import codecs
import os
import posixpath
import re
from collections.abc import Callable
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
INDEX_SUFFIX = ".safetensors.index.json"
# Code a loader with remote code enabled (or an extension import) would run.
PYTHON_EXTENSIONS = (".py", ".pyw", ".pyc", ".pyo")
NATIVE_EXTENSIONS = (".so", ".pyd", ".dll", ".dylib")
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
    return path_kind(entry.path) if entry.kind == "file" else entry.kind


def path_kind(path: str) -> str:
    """How a regular file is checked, by its name: safetensors, index, json, file."""
    if path.endswith(".safetensors"):
        return "safetensors"
    if path.endswith(INDEX_SUFFIX):
        return "index"
    if path.endswith(".json"):
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


def check_file_name(path: str, verdict: FileVerdict) -> None:
    """Refusals by name alone: code files, pickle-capable file types."""
    name = path.rsplit("/", 1)[-1]
    if name.lower().endswith(PYTHON_EXTENSIONS):
        verdict.reject("python-file", "Python code (remote code) is not allowed")
    if name.lower().endswith(NATIVE_EXTENSIONS):
        verdict.reject("native-code", f"{name}: a native library is not allowed")
    if name.lower().endswith(PICKLE_EXTENSIONS):
        verdict.reject("pickle-extension", f"{name}: pickle-capable file type")


def _check_file(root_fd: int, entry: _fs.Entry, verdict: FileVerdict, policy: Policy):
    check_file_name(entry.path, verdict)
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
                _check_magic(fd, size, verdict)  # what it is instead, if known
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
        _check_magic(fd, size, verdict)
        if verdict.kind in ("json", "index"):
            _check_json(fd, size, verdict, policy)
        return None
    finally:
        os.close(fd)


def _check_magic(fd: int, size: int, verdict: FileVerdict) -> None:
    """Content sniffing, whatever the file's name says: archives, pickles (by
    protocol header or by parsing the opcode stream), .npy object arrays, and
    ZIP archives located from their end as ZIP readers do."""
    head = os.pread(fd, _HEAD_BYTES, 0)
    for magic, offset, code, what in MAGIC:
        if head[offset : offset + len(magic)] == magic:
            verdict.reject(code, f"{what} detected by content")
            return
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        verdict.reject(
            "pickle-protocol", f"pickle protocol {head[1]} stream detected by content"
        )
        return
    if head.startswith(NPY_MAGIC):
        _check_npy(fd, verdict)
    else:
        found = _scan_pickle(fd, size)
        if found is not None:
            verdict.reject(*found)
            return
    zip_end = _zip_end_record(fd, size)
    if zip_end is not None:
        verdict.reject(
            "pickle-zip",
            f"ZIP archive (end-of-central-directory record at offset {zip_end}) "
            "detected by content",
        )


# --- pickle opcode streams without a protocol header ---------------------------
#
# Protocol 0/1 pickles (and binary opcodes without a PROTO header) have no
# magic. The unpickler executes opcodes one by one as it reads them, so what
# counts is how far the stream is valid *for the unpickler*, from byte 0 of the
# file: the table below models CPython's unpickler (_pickle.c and pickle.py),
# and is never stricter than it. It treats as invalid only what both surely
# refuse: an unknown opcode, a stack underflow or missing MARK (with the C
# unpickler's mark fence), a negative BINSTRING/LONG4 length, and an argument
# neither can decode (a number that is none, text that is not UTF-8 or ASCII
# where they require it, an unquoted STRING). Each argument check accepts what
# either accepts: the C unpickler takes "I0x10" and "I5\0junk", which
# pickletools refuses, so pickletools cannot be the parser here. Long arguments
# are skipped without reading, so a long first argument costs nothing; text and
# binary formats fail within a few bytes.

_CALL, _IMPORT, _PERSID, _FRAME = "call", "import", "persid", "frame"
# Argument layouts: int n = n fixed bytes; ("len", width, signed) = a length of
# `width` bytes, then that many bytes; "line" / "line2" = one or two "\n"-ended
# lines. _ARG_CHECKS says how an opcode's argument must decode.
# Stack effects: (need, delta) = needs `need` items above the current mark,
# changes the depth by `delta`; the names are the mark-handling ops.
_U1, _U4, _U8 = ("len", 1, False), ("len", 4, False), ("len", 8, False)
_I4 = ("len", 4, True)
_PUSH, _TOP = (0, 1), (1, 0)
_PICKLE_OPS: dict[int, tuple[str, Any, Any, str | None]] = {
    ord(code): (name, arg, effect, kind)
    for code, name, arg, effect, kind in [
        ("I", "INT", "line", _PUSH, None),
        ("J", "BININT", 4, _PUSH, None),
        ("K", "BININT1", 1, _PUSH, None),
        ("M", "BININT2", 2, _PUSH, None),
        ("L", "LONG", "line", _PUSH, None),
        ("\x8a", "LONG1", _U1, _PUSH, None),
        ("\x8b", "LONG4", _I4, _PUSH, None),
        ("S", "STRING", "line", _PUSH, None),
        ("T", "BINSTRING", _I4, _PUSH, None),
        ("U", "SHORT_BINSTRING", _U1, _PUSH, None),
        ("B", "BINBYTES", _U4, _PUSH, None),
        ("C", "SHORT_BINBYTES", _U1, _PUSH, None),
        ("\x8e", "BINBYTES8", _U8, _PUSH, None),
        ("\x96", "BYTEARRAY8", _U8, _PUSH, None),
        ("\x97", "NEXT_BUFFER", 0, _PUSH, None),
        ("\x98", "READONLY_BUFFER", 0, _TOP, None),
        ("N", "NONE", 0, _PUSH, None),
        ("\x88", "NEWTRUE", 0, _PUSH, None),
        ("\x89", "NEWFALSE", 0, _PUSH, None),
        ("V", "UNICODE", "line", _PUSH, None),
        ("\x8c", "SHORT_BINUNICODE", _U1, _PUSH, None),
        ("X", "BINUNICODE", _U4, _PUSH, None),
        ("\x8d", "BINUNICODE8", _U8, _PUSH, None),
        ("F", "FLOAT", "line", _PUSH, None),
        ("G", "BINFLOAT", 8, _PUSH, None),
        ("]", "EMPTY_LIST", 0, _PUSH, None),
        ("a", "APPEND", 0, (2, -1), None),
        ("e", "APPENDS", 0, "extend", None),
        ("l", "LIST", 0, "collect", None),
        (")", "EMPTY_TUPLE", 0, _PUSH, None),
        ("t", "TUPLE", 0, "collect", None),
        ("\x85", "TUPLE1", 0, _TOP, None),
        ("\x86", "TUPLE2", 0, (2, -1), None),
        ("\x87", "TUPLE3", 0, (3, -2), None),
        ("}", "EMPTY_DICT", 0, _PUSH, None),
        ("d", "DICT", 0, "collect", None),
        ("s", "SETITEM", 0, (3, -2), None),
        ("u", "SETITEMS", 0, "extend", None),
        ("\x8f", "EMPTY_SET", 0, _PUSH, None),
        ("\x90", "ADDITEMS", 0, "extend", None),
        ("\x91", "FROZENSET", 0, "collect", None),
        ("0", "POP", 0, "pop", None),
        ("2", "DUP", 0, (1, 1), None),
        ("(", "MARK", 0, "mark", None),
        ("1", "POP_MARK", 0, "pop_mark", None),
        ("g", "GET", "line", _PUSH, None),
        ("h", "BINGET", 1, _PUSH, None),
        ("j", "LONG_BINGET", 4, _PUSH, None),
        ("p", "PUT", "line", _TOP, None),
        ("q", "BINPUT", 1, _TOP, None),
        ("r", "LONG_BINPUT", 4, _TOP, None),
        ("\x94", "MEMOIZE", 0, _TOP, None),
        ("\x80", "PROTO", 1, (0, 0), None),
        # Protocol 4+ framing: the C unpickler reading a file drops the rest
        # of a frame when an argument runs past its end and reads on from the
        # file, so the stream it executes is not the bytes in order. Only
        # protocol 4+ pickles have frames: one that fits in the file rejects.
        # (A longer one is an error to the C unpickler; the Python one reads
        # on in order, as this scan does.)
        ("\x95", "FRAME", 8, (0, 0), _FRAME),
        (".", "STOP", 0, "stop", None),
        # Imports: they bring a callable onto the stack (or hand a value to the
        # loader's persistent_load hook, torch's storage loader).
        ("c", "GLOBAL", "line2", _PUSH, _IMPORT),
        ("\x93", "STACK_GLOBAL", 0, (2, -1), _IMPORT),
        ("\x82", "EXT1", 1, _PUSH, _IMPORT),
        ("\x83", "EXT2", 2, _PUSH, _IMPORT),
        ("\x84", "EXT4", 4, _PUSH, _IMPORT),
        ("P", "PERSID", "line", _PUSH, _PERSID),
        ("Q", "BINPERSID", 0, _TOP, _PERSID),
        # Calls: what runs code.
        ("R", "REDUCE", 0, (2, -1), _CALL),
        ("b", "BUILD", 0, (2, -1), _CALL),
        ("i", "INST", "line2", "collect", _CALL),
        ("o", "OBJ", 0, "obj", _CALL),
        ("\x81", "NEWOBJ", 0, (2, -1), _CALL),
        ("\x92", "NEWOBJ_EX", 0, (3, -2), _CALL),
    ]
}
# Numbers as C's strtol/PyLong_FromString and Python's int()/float() read them
# (a superset of both: whitespace, sign, base prefixes, underscores, inf/nan).
_INT_TEXT = re.compile(rb"\s*[+-]?\s*(?:0[xXoObB][0-9a-fA-F_]*|[0-9][0-9_]*)\s*")
_DECIMAL_TEXT = re.compile(rb"\s*[+-]?\s*[0-9][0-9_]*\s*")
_FLOAT_TEXT = re.compile(
    rb"\s*[+-]?(?:(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9][0-9_]*)(?:e[+-]?[0-9_]*)?"
    rb"|inf(?:inity)?|nan)\s*",
    re.IGNORECASE,
)


def _decodes(data: bytes, encoding: str, errors: str = "strict") -> bool:
    try:
        data.decode(encoding, errors)
    except UnicodeDecodeError:
        return False
    return True


def _escape_decodes(data: bytes) -> bool:
    try:
        codecs.escape_decode(data)
    except ValueError:
        return False
    return True


def _number_text(pattern: re.Pattern[bytes], line: bytes) -> bool:
    # The C unpickler reads the line as a C string: it ends at a NUL byte.
    return pattern.fullmatch(line.split(b"\0", 1)[0]) is not None


def _string_text(line: bytes) -> bool:
    quoted = len(line) >= 2 and line[0] == line[-1] and line[:1] in (b"'", b'"')
    return quoted and _escape_decodes(line[1:-1])


# How an argument must decode for the unpickler to go on (a line without its
# newline, or a length-prefixed payload); opcodes not named take any argument.
_ARG_CHECKS: dict[str, Callable[[bytes], bool]] = {
    # strtol stops at a leading NUL and reports success: "I\0..." is 0 to C.
    "INT": lambda v: v[:1] == b"\0" or _number_text(_INT_TEXT, v),
    "LONG": lambda v: _number_text(_INT_TEXT, v[:-1] if v.endswith(b"L") else v),
    "FLOAT": lambda v: _number_text(_FLOAT_TEXT, v),
    "GET": lambda v: _number_text(_DECIMAL_TEXT, v),
    "PUT": lambda v: _number_text(_DECIMAL_TEXT, v),
    "STRING": _string_text,
    "UNICODE": lambda v: _decodes(v, "raw-unicode-escape"),
    "SHORT_BINUNICODE": lambda v: _decodes(v, "utf-8", "surrogatepass"),
    "BINUNICODE": lambda v: _decodes(v, "utf-8", "surrogatepass"),
    "BINUNICODE8": lambda v: _decodes(v, "utf-8", "surrogatepass"),
    "GLOBAL": lambda v: _decodes(v, "utf-8"),
    "INST": lambda v: _decodes(v, "utf-8"),
    "PERSID": lambda v: _decodes(v, "ascii"),
}
# Arguments longer than this are taken on trust (a longer one costs nothing).
_ARG_CHECK_BYTES = 1 << 16

# A stream still valid after this much is a pickle as far as the gate can tell.
# No other format gets anywhere near: text and binary fail within a few bytes.
_PICKLE_SCAN_BYTES = 64 << 20  # bytes parsed (skipped arguments not counted)
_PICKLE_SCAN_OPS = 1 << 20


class _StreamEnd(Exception):
    """End of file inside the opcode stream: the unpickler stops there."""


class _Undecidable(Exception):
    """Still a valid opcode stream after the scan's budget."""


class _OpReader:
    """Reads forward from offset 0 of `fd` in growing chunks."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.pos = 0
        self.parsed = 0
        self._buf, self._buf_at, self._chunk = b"", 0, 4096

    def _buffer_at(self, pos: int) -> int:
        """Index of `pos` in the buffer, refilling it from `pos` if needed."""
        i = pos - self._buf_at
        if 0 <= i < len(self._buf):
            return i
        if pos >= self.size:
            raise _StreamEnd
        self._buf, self._buf_at = os.pread(self.fd, self._chunk, pos), pos
        self._chunk = min(self._chunk * 2, 1 << 20)
        if not self._buf:
            raise _StreamEnd
        return 0

    def take(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            i = self._buffer_at(self.pos)
            piece = self._buf[i : i + n - len(out)]
            out += piece
            self.pos += len(piece)
        self.parsed += n
        return out

    def skip(self, n: int, *, check: bool) -> bytes | None:
        """Passes `n` bytes; returns them when `check` asks for them and they
        are short enough to check, without reading them otherwise."""
        if self.pos + n > self.size:
            raise _StreamEnd
        if check and n <= _ARG_CHECK_BYTES:
            return self.take(n)
        self.pos += n
        return None

    def line(self) -> bytes | None:
        """Passes one "\\n"-ended line (no newline before EOF: the unpickler
        refuses the line). Returns it without the newline, or None when it is
        too long to check."""
        start = self.pos
        while True:
            if self.pos - start > _PICKLE_SCAN_BYTES - self.parsed:
                raise _Undecidable
            i = self._buffer_at(self.pos)
            newline = self._buf.find(b"\n", i)
            if newline >= 0:
                self.pos = self._buf_at + newline + 1
                self.parsed += self.pos - start
                length = self.pos - 1 - start
                if length > _ARG_CHECK_BYTES:
                    return None
                if start >= self._buf_at:
                    return self._buf[start - self._buf_at : newline]
                return os.pread(self.fd, length, start)
            self.pos = self._buf_at + len(self._buf)


def _scan_pickle(fd: int, size: int) -> tuple[str, str] | None:
    """(code, detail) when the file parses as a pickle opcode stream that calls
    code, a complete pickle that imports, or one still valid after the scan's
    budget; None when it stops being a valid stream first.

    The stream is rejected at the first call opcode (REDUCE, BUILD, INST, OBJ,
    NEWOBJ, NEWOBJ_EX) or import opcode (GLOBAL, STACK_GLOBAL, EXT*) reached
    validly: an import runs the module's top-level code, and the opcodes after it
    (SETITEM, APPEND...) act on the imported object before the stream turns out
    invalid. So text whose first two lines read as a GLOBAL ("cat\\ndog\\n" is
    at.dog) is refused too, a false positive taken for safety. PERSID/BINPERSID
    only hand a value to the loader's own hook (plain pickle refuses them) and
    reject only if their pickle then completes (STOP), so a PNG ("\\x89" NEWFALSE,
    a PERSID of "NG\\r", then invalid) passes. A data-only pickle runs no code; the
    scan goes on past its STOP, as a loader calling load() again would (torch's
    legacy format is several pickles in a row)."""
    reader = _OpReader(fd, size)
    depth, marks = 0, []  # stack depth; depth at each open MARK
    imported: tuple[str, int] | None = None
    ops = 0
    try:
        while True:
            ops += 1
            if ops > _PICKLE_SCAN_OPS or reader.parsed > _PICKLE_SCAN_BYTES:
                raise _Undecidable
            at = reader.pos
            spec = _PICKLE_OPS.get(reader.take(1)[0])
            if spec is None:
                return None
            name, arg, effect, kind = spec
            check = _ARG_CHECKS.get(name)
            if isinstance(arg, int):
                values = [reader.take(arg)]
            elif arg == "line":
                values = [reader.line()]
            elif arg == "line2":
                values = [reader.line(), reader.line()]
            else:
                _, width, signed = arg
                length = int.from_bytes(reader.take(width), "little", signed=signed)
                if length < 0:
                    return None
                values = [reader.skip(length, check=check is not None)]
            if check is not None and not all(v is None or check(v) for v in values):
                return None
            fence = marks[-1] if marks else 0
            if effect == "mark":
                marks.append(depth)
            elif effect == "pop":
                if marks and marks[-1] == depth:
                    marks.pop()
                elif depth > fence:
                    depth -= 1
                else:
                    return None
            elif effect in ("collect", "extend", "obj", "pop_mark"):
                if not marks:
                    return None
                mark = marks.pop()
                fence = marks[-1] if marks else 0
                if (effect == "extend" and mark <= fence) or (
                    effect == "obj" and depth - mark < 1
                ):
                    return None
                depth = mark + (effect in ("collect", "obj"))
            elif effect == "stop":
                if depth <= fence:
                    return None
                if imported is not None:
                    return (
                        "pickle-protocol",
                        f"complete pickle stream (STOP at offset {at}) that "
                        f"imports ({imported[0]} at offset {imported[1]})",
                    )
                depth, marks = 0, []
            else:
                need, delta = effect
                if depth - fence < need:
                    return None
                depth += delta
            if kind in (_CALL, _IMPORT):
                does = "calls code" if kind == _CALL else "imports a module"
                return (
                    "pickle-protocol",
                    f"pickle opcode stream that {does} ({name} at offset {at}) "
                    "detected by content",
                )
            if kind == _FRAME and int.from_bytes(values[0], "little") <= (
                size - reader.pos
            ):
                return (
                    "pickle-protocol",
                    f"framed (protocol 4+) pickle opcode stream (FRAME at offset "
                    f"{at}) detected by content",
                )
            if kind == _PERSID and imported is None:
                imported = (name, at)
    except _StreamEnd:
        return None
    except _Undecidable:
        return (
            "pickle-undecidable",
            f"still a valid pickle opcode stream after {reader.pos} bytes "
            f"({ops} opcodes); a file that may be a pickle is not allowed",
        )


# ZIP readers find an archive from its end: the end-of-central-directory
# record lies within the last 64 KiB + 22 bytes (a comment of up to 65535
# bytes may follow it), so bytes in front of the archive do not hide it.
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SIZE = 22


def _zip_end_record(fd: int, size: int) -> int | None:
    """Offset of a ZIP end-of-central-directory record, as zipfile finds one:
    the signature with a whole 22-byte record after it, in the file's tail.
    zipfile does not check the comment length against the file's end, so
    neither does this (any record a lenient reader could take counts)."""
    start = max(size - (1 << 16) - _ZIP_END_SIZE, 0)
    tail = os.pread(fd, size - start, start)
    found = tail.rfind(_ZIP_END, 0, max(len(tail) - _ZIP_END_SIZE + len(_ZIP_END), 0))
    return None if found < 0 else start + found


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
