"""A GGUF file's byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) rebuilt as
a `tokenizers.Tokenizer` plus its `tokenizer_config.json`.

What the GGUF metadata says, and where it goes:

- `tokenizer.ggml.tokens` (already in GPT-2's byte-to-unicode spelling) and
  `tokenizer.ggml.merges` ("a b" strings, best first) -> a BPE model with that vocab,
  id = position in the list;
- `tokenizer.ggml.token_type` -> CONTROL (3) tokens become special added tokens (matched
  whole in text, skipped when decoding with skip_special_tokens), USER_DEFINED (4)
  plain added tokens (matched whole); ids never change;
- `tokenizer.ggml.pre` -> the pre-tokenizer llama.cpp uses for that name; only names
  whose split we implement are accepted (others are an error naming them);
- `tokenizer.ggml.add_bos_token` / `add_eos_token` -> the post-processor (BOS/EOS
  added by `encode(..., add_special_tokens=True)`) and the same flags in
  tokenizer_config.json, so the tokenizer's own rule says what a prompt starts with;
- `tokenizer.ggml.{bos,eos,unknown,padding}_token_id` and `tokenizer.chat_template`
  -> tokenizer_config.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# llama.cpp's token types that a byte-level BPE vocab may carry; UNKNOWN (2), UNUSED
# (5) and BYTE (6) belong to sentencepiece vocabularies.
SUPPORTED_TOKEN_TYPES = (TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)

SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


class TokenizerConversionError(ValueError):
    """The GGUF tokenizer is not one this converter rebuilds; the message says why."""


def _byte_level(add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    # GPT-2's split regex (contractions, ' ?\p{L}+', ' ?\p{N}+', punctuation runs,
    # spaces), then bytes -> printable unicode.
    return pre_tokenizers.ByteLevel(
        add_prefix_space=add_prefix_space, trim_offsets=True, use_regex=True
    )


def _smollm(add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm" pre-type: every \p{N} on its own first, then GPT-2's regex
    # (the vocab was trained that way: no merge joins two digits).
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            _byte_level(add_prefix_space),
        ]
    )


PRE_TOKENIZERS = {"gpt2": _byte_level, "smollm": _smollm}


def build_tokenizer(metadata: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer_config dict) from a GGUF file's metadata (field name ->
    value, arrays as lists). Raises TokenizerConversionError for tokenizer kinds,
    pre-tokenizers or token types this does not implement."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerConversionError(
            f"tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, "
            "'gpt2')"
        )
    pre = metadata.get("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerConversionError(
            f"tokenizer.ggml.pre {pre!r} is not supported; supported: "
            f"{sorted(PRE_TOKENIZERS)}"
        )
    tokens = list(_required(metadata, "tokenizer.ggml.tokens"))
    merges = list(_required(metadata, "tokenizer.ggml.merges"))
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerConversionError(
            f"{len(tokens)} tokens but {len(types)} token types"
        )
    unsupported = sorted({t for t in types if t not in SUPPORTED_TOKEN_TYPES})
    if unsupported:
        raise TokenizerConversionError(
            f"token types {unsupported} are not supported in a byte-level vocab"
        )
    vocab = {}
    for index, token in enumerate(tokens):
        if token in vocab:
            raise TokenizerConversionError(
                f"token {token!r} appears twice (ids {vocab[token]} and {index})"
            )
        vocab[token] = index
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2 or (parts[0] + parts[1]) not in vocab:
            raise TokenizerConversionError(f"merge {merge!r} is not 'a b' of the vocab")
        pairs.append((parts[0], parts[1]))

    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    )
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre](add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types, strict=True)
            if kind == TOKEN_TYPE_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, types, strict=True)
            if kind == TOKEN_TYPE_USER_DEFINED
        ]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise TokenizerConversionError("adding the special tokens changed the vocab")

    special = {}
    for name, key in SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(key)
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise TokenizerConversionError(f"{key}={token_id} is outside the vocab")
        special[name] = tokens[token_id]
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    tokenizer.post_processor = _post_processor(special, vocab, add_bos, add_eos)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    context_length = metadata.get("llama.context_length")
    if context_length:
        config["model_max_length"] = int(context_length)
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tokenizer, config


def _post_processor(
    special: Mapping[str, str], vocab: Mapping[str, int], add_bos: bool, add_eos: bool
) -> processors.PostProcessor:
    # What encode(add_special_tokens=True) adds: BOS/EOS as the GGUF says, else
    # nothing (ByteLevel only fixes offsets).
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False)
    flags = (("bos_token", add_bos), ("eos_token", add_eos))
    added = [name for name, on in flags if on]
    missing = [name for name in added if name not in special]
    if missing:
        raise TokenizerConversionError(f"add_{missing[0]} is set but there is none")
    head = [special["bos_token"]] if add_bos else []
    tail = [special["eos_token"]] if add_eos else []

    def wrap(sequence: str) -> str:
        return " ".join([*head, sequence, *tail])

    return processors.TemplateProcessing(
        single=wrap("$A"),
        pair=f"{wrap('$A')} {wrap('$B:1')}",
        special_tokens=[(special[name], vocab[special[name]]) for name in added],
    )


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise TokenizerConversionError(f"the GGUF metadata has no {key}")
    return metadata[key]
