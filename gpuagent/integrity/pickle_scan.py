"""Pickle opcode streams found by parsing them as CPython's unpicklers would.

`scan_pickle` reads a byte range from its start and follows it opcode by opcode
as both of CPython's unpicklers do (the C one, `_pickle`, and the pure-Python
one, `pickle._Unpickler`, which joblib uses), and refuses a range that either
would import from or call code through.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from typing import Any

from gpuagent.integrity._fs import FileRange

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
    """Reads forward from the start of a FileRange in growing chunks."""

    def __init__(self, source: FileRange):
        self.source, self.size = source, source.size
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
        self._buf, self._buf_at = self.source.read_at(self._chunk, pos), pos
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

    def line(self, *, python_eof: bool = False) -> bytes | None:
        """Passes one "\\n"-ended line and returns it without the newline, or
        None when it is too long to check. No newline before EOF: the C
        unpickler refuses the line (_StreamEnd); with `python_eof` the line is
        what the pure-Python unpickler takes instead, its readline's rest of the
        file less the last byte (`readline()[:-1]`), and the scan ends after it."""
        start = self.pos
        while True:
            if self.pos - start > _PICKLE_SCAN_BYTES - self.parsed:
                raise _Undecidable
            try:
                i = self._buffer_at(self.pos)
            except _StreamEnd:
                if not python_eof:
                    raise
                self.parsed += self.pos - start
                rest = self.pos - start
                return self.source.read_at(rest - 1, start) if rest > 0 else b""
            newline = self._buf.find(b"\n", i)
            if newline >= 0:
                self.pos = self._buf_at + newline + 1
                self.parsed += self.pos - start
                length = self.pos - 1 - start
                if length > _ARG_CHECK_BYTES:
                    return None
                if start >= self._buf_at:
                    return self._buf[start - self._buf_at : newline]
                return self.source.read_at(length, start)
            self.pos = self._buf_at + len(self._buf)


def scan_pickle(source: FileRange) -> tuple[str, str] | None:
    """(code, detail) when the range parses as a pickle opcode stream that calls
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
    legacy format is several pickles in a row).

    Where the two unpicklers differ, the scan takes the more lenient: the
    pure-Python one imports for GLOBAL and INST even when their lines run into
    the end of the file (its readline returns the rest, less one byte), and for
    INST before it looks for the MARK INST needs."""
    size = source.size
    reader = _OpReader(source)
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
            elif arg == "line2":  # GLOBAL, INST: see the docstring on EOF
                values = [reader.line(python_eof=True), reader.line(python_eof=True)]
            else:
                _, width, signed = arg
                length = int.from_bytes(reader.take(width), "little", signed=signed)
                if length < 0:
                    return None
                values = [reader.skip(length, check=check is not None)]
            if check is not None and not all(v is None or check(v) for v in values):
                return None
            if arg == "line2":  # both import before any check of the stack
                return _refusal(name, at, "imports a module")
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
                return _refusal(name, at, does)
            if kind == _FRAME and int.from_bytes(values[0], "little") <= (
                size - reader.pos
            ):
                return (
                    "pickle-protocol",
                    f"framed (protocol 4+) pickle opcode stream (FRAME at offset {at})",
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


def _refusal(name: str, at: int, does: str) -> tuple[str, str]:
    return (
        "pickle-protocol",
        f"pickle opcode stream that {does} ({name} at offset {at})",
    )
