"""Text that is safe to print: names from model folders and signatures can hold
characters that forge or reorder the lines of a report."""

from __future__ import annotations

import unicodedata


def unsafe_char(char: str) -> bool:
    """Whether printing `char` raw could forge or reorder report text: C0 and C1
    controls (newline, ESC, U+0085 NEL, U+009B CSI), line and paragraph
    separators (U+2028/2029), and format characters, which hold every
    bidirectional control (U+202A-202E, U+2066-2069, U+200E/200F, U+061C) and
    invisible ones (U+200B, U+FEFF); and lone surrogates (a name that is not
    UTF-8)."""
    return unicodedata.category(char) in _UNSAFE_CATEGORIES


_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def printable(text: str) -> str:
    """`text` (a path, or a message naming one) safe to print and serialize:
    every character `unsafe_char` names is written as a Python escape (\\n,
    \\x85, \\u202e); when any is, backslashes are doubled too, so an escape
    can't be told from a name that spells one. Other text (Korean, emoji) is kept
    as it is."""
    if not any(unsafe_char(c) for c in text):
        return text
    return "".join(ascii(c)[1:-1] if c == "\\" or unsafe_char(c) else c for c in text)


def printable_lines(text: str) -> str:
    """`printable` for a multi-line message we wrote: each line escaped, our own
    newlines kept."""
    return "\n".join(printable(line) for line in text.split("\n"))
