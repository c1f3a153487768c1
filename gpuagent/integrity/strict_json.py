"""Strict, bounded JSON: one reading of a document, at a bounded cost.

`strict_json_loads` rejects what parsers could read differently (duplicate keys
at any depth, NaN/Infinity literals, numbers that overflow to inf, lone surrogate
escapes) and, before the parser builds anything, documents nested deeper than a
limit or holding more elements than a limit. The count is taken on the text with
its strings blanked out, by C-speed string operations, so a hostile document
(99 MB of `[],[],...`, millions of empty lists: gigabytes as Python objects) is
refused in about the time it takes to read it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

# Elements a JSON file or safetensors header may hold, counted as the structural
# characters ",", "[" and "{" outside strings (each element but a container's
# first follows a comma). A 256k-token tokenizer.json with its merges holds about
# 2M; 4M parse in about 4 s and 0.8 GB on this machine.
DEFAULT_MAX_ELEMENTS = 1 << 22
# A byte-order mark decoded from UTF-8: transformers reads config.json as
# UTF-8 text and json.loads refuses it there ("Unexpected UTF-8 BOM"), as the
# tokenizers library does tokenizer.json; refused here by name.
BOM = "\ufeff"


class Rejected(Exception):
    """A structural defect; `code` names it (tests and reports key on it)."""

    def __init__(self, code: str, detail: str):
        self.code, self.detail = code, detail
        super().__init__(f"[{code}] {detail}")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise Rejected("duplicate-key", f"key {key!r} appears twice")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise Rejected("nonfinite-literal", f"JSON literal {name} is not allowed")


def _finite_float(text: str) -> float:
    # "1e999" is no NaN/Infinity literal, but float() makes it inf all the same.
    value = float(text)
    if not math.isfinite(value):
        raise Rejected("nonfinite-number", f"number {text[:40]} overflows to {value}")
    return value


_DECODER = json.JSONDecoder(
    object_pairs_hook=_reject_duplicates,
    parse_constant=_reject_constant,
    parse_float=_finite_float,
)
# A JSON string: from a quote to the next quote not escaped (the unrolled form
# runs in the regex engine's fast loops).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_JSON_WHITESPACE = " \t\n\r"


def _check_shape(text: str, max_depth: int, max_elements: int) -> None:
    """Rejects `text` nested deeper than `max_depth` or with more than
    `max_elements` elements, without parsing it. Exact for valid JSON; for
    invalid JSON the parser fails on it anyway, having built no more than this
    allows."""
    skeleton = _STRING.sub('""', text)
    openers = skeleton.count("[") + skeleton.count("{")
    elements = openers + skeleton.count(",")
    if elements > max_elements:
        raise Rejected(
            "too-many-elements",
            f"{elements} JSON elements, more than the limit of {max_elements}",
        )
    if openers <= max_depth:
        return
    brackets = skeleton.encode("ascii", "replace").translate(None, _NOT_BRACKETS)
    if len(brackets) > 2 * openers:
        return  # more closers than openers: invalid, the parser fails early
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    depth = int(np.cumsum(steps, dtype=np.int64).max(initial=0))
    if depth > max_depth:
        raise Rejected(
            "nesting-too-deep", f"JSON nesting {depth} exceeds the limit {max_depth}"
        )


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_strings(value: Any) -> None:
    """Rejects a string holding a lone surrogate escape ("\\ud800"), which is no
    Unicode text: the Rust safetensors parser refuses it, and no JSON report or
    database can hold it. Walks every key and string (bounded by the element
    limit)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not _is_unicode(item):
            raise Rejected(
                "string-not-unicode", f"string {item!r} holds a lone surrogate"
            )


def strict_json_loads(
    text: str,
    max_depth: int,
    *,
    safetensors_header: bool = False,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
):
    """json.loads that rejects duplicate keys at any depth, NaN/Infinity (as
    literals or as numbers too large for a float, "1e999"), lone surrogate
    escapes, nesting deeper than `max_depth` and more than `max_elements`
    elements (the last two before parsing), and a leading byte-order mark.
    Raises Rejected.

    A JSON document may have whitespace around it; a safetensors header must
    start with `{` (checked by the caller) and may only be padded with spaces.
    """
    if text.startswith(BOM):
        raise Rejected(
            "utf8-bom",
            "starts with a UTF-8 byte-order mark (EF BB BF), which JSON readers "
            "refuse (transformers, tokenizers, json.loads of text); save it "
            "without the BOM",
        )
    _check_shape(text, max_depth, max_elements)
    start = 0 if safetensors_header else len(text) - len(text.lstrip(_JSON_WHITESPACE))
    try:
        value, end = _DECODER.raw_decode(text, start)
    except Rejected:
        raise
    except RecursionError as e:
        raise Rejected("nesting-too-deep", "JSON nesting is too deep") from e
    except ValueError as e:
        raise Rejected("invalid-json", str(e)) from e
    rest = text[end:]
    padding = " " if safetensors_header else _JSON_WHITESPACE
    if rest.strip(padding):
        code = "header-bad-padding" if safetensors_header else "invalid-json"
        raise Rejected(code, f"{len(rest)} unexpected character(s) after JSON")
    if _SURROGATE_ESCAPE.search(text):
        _check_strings(value)
    return value
