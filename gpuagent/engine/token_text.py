"""Token text as OpenAI's logprobs report it: each token's exact bytes (byte-level,
byte-fallback, ByteLevel BPE), `bytes:\\xNN` text for part of a UTF-8 character, and
the `text_offset` of each token in the text returned (generated or echoed prompt).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from gpuagent.engine.engine import RequestOutput

CUT_OFF_CHAR = "\ufffd"  # what a cut-off (or invalid) UTF-8 sequence decodes to
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in char -> byte, as tokenizers' ByteLevel uses it."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if chr(b) not in table]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


BYTE_LEVEL_CHARS = _byte_level_table()


def _decoder_types(tokenizer: Any) -> set[str]:
    """The component types of a `tokenizers` decoder (Sequence members included)."""
    decoder = getattr(getattr(tokenizer, "inner", None), "decoder", None)
    try:
        tree = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except Exception:  # noqa: BLE001 - not a tokenizers decoder: no special handling
        return set()
    types, todo = set(), [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            types.add(node.get("type"))
            todo.extend(node.get("decoders") or [])
    return types


class TokenBytes:
    """The exact bytes of each token id (cached), as OpenAI's logprobs report them:
    an added token's content; a byte-fallback token `<0xNN>` is byte NN; a ByteLevel
    (GPT-2 style) token's chars map back through the bytes-to-unicode table (so the
    byte-level tokenizer's id < 256 is that byte); else the token decoded alone,
    which is not exact where the decoder strips (SentencePiece's `Strip` drops a
    `▁word` token's leading space)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        inner = getattr(tokenizer, "inner", None)
        types = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in types
        self.byte_fallback = "ByteFallback" in types
        self.id_to_token = getattr(inner, "id_to_token", None)
        added = getattr(inner, "get_added_tokens_decoder", None)
        self.added = {i: t.content for i, t in added().items()} if added else {}
        self.cache: dict[int, bytes] = {}
        self.skipped = {
            i for i in self.added if not tokenizer.decode([i], skip_special_tokens=True)
        }

    def is_skipped(self, token_id: int) -> bool:
        """Whether the text leaves the token out (a special token)."""
        return token_id in self.skipped

    def __call__(self, token_id: int) -> bytes:
        raw = self.cache.get(token_id)
        if raw is None:
            raw = self.cache[token_id] = self._bytes(token_id)
        return raw

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.id_to_token(token_id) if self.id_to_token else None
        if piece is not None:
            byte = _BYTE_FALLBACK.fullmatch(piece)
            if self.byte_fallback and byte:
                return bytes([int(byte.group(1), 16)])
            if self.byte_level and all(c in BYTE_LEVEL_CHARS for c in piece):
                return bytes(BYTE_LEVEL_CHARS[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")


def bytes_text(raw: bytes) -> str:
    """A token's text: `raw` decoded, or `bytes:\\xNN...` (as OpenAI writes it) when
    `raw` is not valid UTF-8 on its own (part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """The `text_offset` of each generated token: where, in the request's text, the
    character its first byte belongs to starts, so a byte that completes a character
    later points at that character (the text's U+FFFD until then).

    Fed each `RequestOutput` in order; the offsets come from the engine's text
    before and after each token, so they agree with the `text` returned. Tokens of
    a matched stop string point where they would have been, past the cut text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""  # the text before the next token
        self.offsets: list[int] = []  # every token's so far

    def feed(self, out: RequestOutput) -> list[int]:
        """The offsets of `out.new_logprobs`' tokens."""
        n = len(out.new_logprobs)
        # The engine yields one token per output; the text after each token but the
        # last of a bigger step is decoded as the engine's detokenizer would.
        start = len(out.token_ids) - n
        texts = [
            self.tokenizer.decode(out.token_ids[: start + j], skip_special_tokens=True)
            for j in range(1, n)
        ]
        offsets = []
        for text in [*texts, out.text]:
            offsets.append(len(self.text) - _continues_cut_char(self.text, text))
            self.text = text
        del offsets[n:]  # an output without logprobs still moves the text on
        self.offsets += offsets
        return offsets


def _continues_cut_char(before: str, after: str) -> bool:
    """Whether the token that turned `before` into `after` is part of `before`'s last
    character, a cut-off one (U+FFFD): it completed it, or it is still cut off."""
    if not before.endswith(CUT_OFF_CHAR) or len(after) < len(before):
        return False  # not cut off, or a stop string cut the text
    last = len(before) - 1
    return after[last] != CUT_OFF_CHAR or len(after) == len(before)


def prompt_text_offsets(token_bytes: TokenBytes, token_ids: Sequence[int]) -> list[int]:
    """The `text_offset` of each prompt token in the prompt's text (special tokens
    skipped, as the text leaves them out): the index of the character its first byte
    belongs to, counted over the tokens' exact bytes as UTF-8 (a byte that can't
    start or continue a character is one U+FFFD, as a decoder writes it)."""
    offsets = []
    chars = 0  # characters begun before the current one
    need = 0  # continuation bytes the current character still needs
    for token_id in token_ids:
        offsets.append(chars)
        raw = b"" if token_bytes.is_skipped(token_id) else token_bytes(token_id)
        for byte in raw:
            if need and 0x80 <= byte < 0xC0:
                need -= 1
                chars += need == 0
                continue
            if need:  # cut off: the partial character is one U+FFFD
                chars, need = chars + 1, 0
            if 0xC0 <= byte < 0xF8:
                need = 1 + (byte >= 0xE0) + (byte >= 0xF0)
            else:
                chars += 1
    return offsets
