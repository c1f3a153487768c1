"""A `tiktoken.model` read as data: lines of "base64(token bytes) rank", strictly.

The ranks must be 0..n-1, each once; tokens must be distinct, non-empty and at
most `MAX_TOKEN_BYTES` long; every single byte must have a rank (a byte-level BPE
cannot encode a text holding a byte it lacks). Any problem raises
`TiktokenFileError` naming the line. Nothing here imports or runs anything from
the model folder: the file is parsed, never evaluated.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path

MAX_FILE_BYTES = 64 << 20  # Kimi K2's is 2.8 MB
MAX_TOKENS = 1 << 22
MAX_TOKEN_BYTES = 1024
_LINE = re.compile(rb"([A-Za-z0-9+/]+={0,2}) (0|[1-9][0-9]{0,9})")


class TiktokenFileError(ValueError):
    """The rank file is not a valid tiktoken.model; the message says where."""


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """The mergeable ranks of the tiktoken.model at `path` (size checked first)."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise TiktokenFileError(
            f"{path.name}: {size} bytes, more than the limit of {MAX_FILE_BYTES}"
        )
    return parse_ranks(path.read_bytes(), name=path.name)


def parse_ranks(data: bytes, name: str = "tiktoken.model") -> dict[bytes, int]:
    """token bytes -> rank of a tiktoken rank file's bytes."""
    if len(data) > MAX_FILE_BYTES:
        raise TiktokenFileError(f"{name}: more than {MAX_FILE_BYTES} bytes")
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        where = f"{name} line {number}"
        match = _LINE.fullmatch(line)
        if match is None:
            raise TiktokenFileError(
                f"{where}: not '<base64 token> <rank>' ({_shown(line)})"
            )
        try:
            token = base64.b64decode(match.group(1), validate=True)
        except binascii.Error as e:
            raise TiktokenFileError(f"{where}: token is not base64 ({e})") from None
        rank = int(match.group(2))
        if not token:
            raise TiktokenFileError(f"{where}: empty token")
        if len(token) > MAX_TOKEN_BYTES:
            raise TiktokenFileError(
                f"{where}: token of {len(token)} bytes, more than {MAX_TOKEN_BYTES}"
            )
        if token in ranks:
            raise TiktokenFileError(
                f"{where}: token {token!r} again (rank {ranks[token]} before)"
            )
        if rank in line_of_rank:
            raise TiktokenFileError(
                f"{where}: rank {rank} again (line {line_of_rank[rank]})"
            )
        if len(ranks) >= MAX_TOKENS:
            raise TiktokenFileError(f"{where}: more than {MAX_TOKENS} tokens")
        ranks[token] = rank
        line_of_rank[rank] = number
    if not ranks:
        raise TiktokenFileError(f"{name}: no tokens")
    missing_rank = next((r for r in range(len(ranks)) if r not in line_of_rank), None)
    if missing_rank is not None:
        top = max(line_of_rank)
        raise TiktokenFileError(
            f"{name}: ranks are not contiguous: rank {missing_rank} is missing "
            f"(line {line_of_rank[top]} has rank {top}, {len(ranks)} tokens)"
        )
    missing_byte = next((b for b in range(256) if bytes([b]) not in ranks), None)
    if missing_byte is not None:
        raise TiktokenFileError(
            f"{name}: byte 0x{missing_byte:02x} has no rank (a byte-level BPE "
            "needs all 256)"
        )
    return ranks


def _shown(line: bytes, limit: int = 60) -> str:
    text = repr(line[:limit])
    return text + ("..." if len(line) > limit else "")
