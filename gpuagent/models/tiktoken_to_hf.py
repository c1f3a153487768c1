"""tiktoken ranks -> a byte-level BPE `tokenizer.json` for the `tokenizers` library.

tiktoken splits a text by its pattern, then merges each piece's bytes pair by
pair, always the adjacent pair whose concatenation has the lowest rank, and takes
a piece that is itself a token whole. The `tokenizers` BPE does the same given:

- the vocabulary: each token's bytes (as ByteLevel's printable characters) -> its
  rank, which is its id;
- the merges, in rank order: for each token of two or more bytes, the two parts
  that merging its own bytes by lowest rank (stopping below the token's rank)
  ends with. A token those merges cannot build is left out of the merges, as
  tiktoken can then only produce it whole, which `ignore_merges` keeps;
- `ignore_merges`: a pre-token that is in the vocabulary is one token;
- the pattern as a Split pre-tokenizer, then ByteLevel without its own regex;
- the special tokens at their ids, matched before any of that.

The equivalence is checked against the `tiktoken` package in the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from gpuagent.engine.tokenizer import _bytes_to_unicode
from gpuagent.models.tiktoken_file import parse_ranks
from gpuagent.models.tiktoken_patterns import TiktokenSpec, spec_for

ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class ConversionError(ValueError):
    """The ranks and tokenizer_config.json cannot make one tokenizer; says why."""


@dataclass(frozen=True)
class SpecialToken:
    id: int
    content: str
    flags: dict[str, bool]


def special_tokens(
    base: int, spec: TiktokenSpec, added_tokens_decoder: Mapping[str, Any]
) -> list[SpecialToken]:
    """The special tokens at ids base .. base+spec.reserved_specials-1: those
    added_tokens_decoder names (id -> {"content", flags}), the rest reserved."""
    end = base + spec.reserved_specials
    named: dict[int, SpecialToken] = {}
    for key, entry in added_tokens_decoder.items():
        where = f"added_tokens_decoder[{key!r}]"
        if not (isinstance(key, str) and key.isdigit()):
            raise ConversionError(f"{where}: the key is not a token id")
        token_id = int(key)
        if not base <= token_id < end:
            raise ConversionError(
                f"{where}: id {token_id} is outside the special block "
                f"{base}..{end - 1} of {spec.name}"
            )
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ConversionError(f"{where}: not an object with a string content")
        if not entry["content"]:
            raise ConversionError(f"{where}: empty content")
        flags = {}
        for flag in ADDED_TOKEN_FLAGS:
            value = entry.get(flag, flag == "special")
            if not isinstance(value, bool):
                raise ConversionError(f"{where}: {flag} is not true or false")
            flags[flag] = value
        named[token_id] = SpecialToken(token_id, entry["content"], flags)
    tokens = [
        named.get(i)
        or SpecialToken(i, spec.reserved_name.format(id=i), _reserved_flags())
        for i in range(base, end)
    ]
    seen: dict[str, int] = {}
    for token in tokens:
        if token.content in seen:
            raise ConversionError(
                f"special token {token.content!r} at ids {seen[token.content]} "
                f"and {token.id}"
            )
        seen[token.content] = token.id
    return tokens


def _reserved_flags() -> dict[str, bool]:
    return {flag: flag == "special" for flag in ADDED_TOKEN_FLAGS}


def bpe_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges, in the order of the ranks of the tokens they make."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = _merge_below(ranks, token, rank)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def _merge_below(ranks: Mapping[bytes, int], token: bytes, limit: int) -> list[bytes]:
    """`token`'s bytes merged as tiktoken merges them, by lowest rank (leftmost
    on a tie), using only ranks below `limit`."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def build_tokenizer(
    ranks: Mapping[bytes, int],
    spec: TiktokenSpec,
    added_tokens_decoder: Mapping[str, Any],
) -> HFTokenizer:
    """The `tokenizers.Tokenizer` equivalent of tiktoken with these ranks, the
    spec's pattern and the special tokens (ids exactly as tiktoken gives them)."""
    char_of = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(char_of[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
    inner = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False)
    )
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=False, use_regex=False
            ),
        ]
    )
    inner.decoder = decoders.ByteLevel()
    specials = special_tokens(len(ranks), spec, added_tokens_decoder)
    for token in specials:  # in id order: each lands on the next id
        added = AddedToken(token.content, **token.flags)
        if token.flags["special"]:
            inner.add_special_tokens([added])
        else:
            inner.add_tokens([added])
        if inner.token_to_id(token.content) != token.id:
            raise ConversionError(
                f"special token {token.content!r} should be id {token.id} but is "
                f"{inner.token_to_id(token.content)} (its text is also a BPE token?)"
            )
    return inner


def convert(tiktoken_model: bytes, tokenizer_config: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer a folder's tiktoken.model and tokenizer_config.json define,
    for the reviewed tokenizer the config names (`tiktoken_patterns.spec_for`)."""
    spec = spec_for(dict(tokenizer_config))
    ranks = parse_ranks(tiktoken_model)
    decoder = tokenizer_config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise ConversionError("added_tokens_decoder is not an object")
    return build_tokenizer(ranks, spec, decoder)
