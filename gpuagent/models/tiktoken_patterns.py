"""The reviewed tiktoken tokenizers a published folder may name, and how to rebuild
each as data: its pre-tokenizer pattern and its block of special ids.

A tiktoken tokenizer is defined by code in the folder (Kimi K2's
`tokenization_kimi.py`): the pattern and the special-token rule live there, not in
any data file. We never read that code; each entry below was written from a
review of the published file, keyed by what `tokenizer_config.json` names (its
`tokenizer_class` and its `auto_map` AutoTokenizer entry). A tokenizer not in
the table is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnknownTokenizerError(ValueError):
    """tokenizer_config.json names a tokenizer that has no reviewed entry."""


@dataclass(frozen=True)
class TiktokenSpec:
    name: str  # for messages and the provenance file
    vocab_file: str  # the rank file, in the folder
    pattern: str  # the pre-tokenizer regex (tiktoken's pat_str)
    # ids len(ranks) .. len(ranks)+reserved-1 are special tokens: those
    # tokenizer_config.json's added_tokens_decoder names, the rest
    # reserved_name.format(id=...)
    reserved_specials: int
    reserved_name: str


# moonshotai/Kimi-K2-Instruct tokenization_kimi.py, TikTokenTokenizer: pat_str
# (Han runs split off first; the letter classes subtract Han with `&&`), and
# num_reserved_special_tokens = 256 named from added_tokens_decoder, else
# "<|reserved_token_{id}|>".
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
KIMI = TiktokenSpec(
    name="kimi (tokenization_kimi.TikTokenTokenizer)",
    vocab_file="tiktoken.model",
    pattern=KIMI_PATTERN,
    reserved_specials=256,
    reserved_name="<|reserved_token_{id}|>",
)

# (tokenizer_class, auto_map AutoTokenizer slow-class entry) -> spec
REVIEWED = {("TikTokenTokenizer", "tokenization_kimi.TikTokenTokenizer"): KIMI}


def custom_tokenizer_named(config: dict[str, Any]) -> tuple[str, str] | None:
    """(tokenizer_class, auto_map entry) when tokenizer_config.json asks for a
    tokenizer defined by code in the folder (an auto_map AutoTokenizer entry), or
    None when it names none."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict) or "AutoTokenizer" not in auto_map:
        return None
    entry = auto_map["AutoTokenizer"]
    # transformers writes [slow class, fast class or null], or a bare string
    slow = entry[0] if isinstance(entry, list) and entry else entry
    return str(config.get("tokenizer_class")), str(slow)


def spec_for(config: dict[str, Any]) -> TiktokenSpec:
    """The reviewed spec of the custom tokenizer tokenizer_config.json names."""
    named = custom_tokenizer_named(config)
    if named is None:
        raise UnknownTokenizerError(
            "tokenizer_config.json names no custom tokenizer (auto_map AutoTokenizer)"
        )
    spec = REVIEWED.get(named)
    if spec is None:
        known = ", ".join(f"{c} ({m})" for c, m in REVIEWED)
        raise UnknownTokenizerError(
            f"tokenizer {named[0]!r} from {named[1]!r} has no reviewed conversion "
            f"(known: {known}); its code is never run, so it cannot be imported"
        )
    return spec
