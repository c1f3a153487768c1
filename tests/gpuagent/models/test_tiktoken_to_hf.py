"""The tiktoken -> tokenizer.json converter against the `tiktoken` package itself:
the same ranks, Kimi K2's pattern and special tokens give the same ids on English,
Korean, Chinese, code, whitespace runs, digits and special tokens, and the ids
decode back to the text. Bad rank files and unknown tokenizers are refused by
name."""

from __future__ import annotations

import base64
import re

import pytest
import tiktoken
from tokenizers import Tokenizer as HFTokenizer

from gpuagent.models import corpus
from gpuagent.models.tiktoken_file import TiktokenFileError, parse_ranks
from gpuagent.models.tiktoken_patterns import KIMI, UnknownTokenizerError
from gpuagent.models.tiktoken_to_hf import ConversionError, bpe_merges, convert
from tests.gpuagent.models.tiktoken_fixture import (
    SAMPLES,
    kimi_special_ids,
    kimi_tokenizer_config,
    random_texts,
    substring_ranks,
    tiktoken_model_bytes,
    trained_ranks,
)


@pytest.fixture(scope="module")
def pair():
    """(tiktoken's Encoding, our tokenizer through a tokenizer.json round trip)."""
    ranks = trained_ranks()
    base = len(ranks)
    config = kimi_tokenizer_config(base)
    ours = convert(tiktoken_model_bytes(ranks), config)
    ours = HFTokenizer.from_str(ours.to_str())  # what the folder holds
    oracle = tiktoken.Encoding(
        "kimi-test",
        pat_str=KIMI.pattern,
        mergeable_ranks=ranks,
        special_tokens=kimi_special_ids(base),
    )
    return oracle, ours, base


def _texts(base: int) -> dict[str, str]:
    texts = dict(SAMPLES)
    texts["specials"] = texts["specials"].format(r=base + 20)
    return texts


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_ids_match_tiktoken_and_decode_back(pair, kind):
    oracle, ours, base = pair
    text = _texts(base)[kind]
    expected = oracle.encode(text, allowed_special="all")
    got = ours.encode(text, add_special_tokens=False).ids
    assert got == expected
    assert ours.decode(got, skip_special_tokens=False) == text
    assert oracle.decode(got) == text


def test_held_out_corpus_text_matches(pair):
    # text the merges were not trained on: held-out docs, Korean and code
    oracle, ours, _ = pair
    heldout = corpus.english_docs(heldout=True)[:20] + [
        corpus.korean_plain_text(
            corpus.korean_pairs(corpus.django_korean_catalogs(), heldout=True)
        )[:20_000]
    ]
    for text in heldout:
        assert ours.encode(text, add_special_tokens=False).ids == oracle.encode(
            text, disallowed_special=()
        )


def test_special_ids_and_the_merges_used(pair):
    oracle, ours, base = pair
    assert ours.token_to_id("[BOS]") == base
    assert ours.token_to_id("[PAD]") == base + 255
    assert ours.token_to_id(f"<|reserved_token_{base + 5}|>") == base + 5
    assert ours.get_vocab_size(with_added_tokens=True) == base + 256
    # a merge per trained token (each is built from two lower-ranked tokens)
    assert len(bpe_merges(trained_ranks())) == base - 256


def _line(rank: int, token: bytes) -> bytes:
    return base64.b64encode(token) + b" " + str(rank).encode()


def _good_lines() -> list[bytes]:
    return [_line(b, bytes([b])) for b in range(256)]


@pytest.mark.parametrize(
    "lines, message",
    [
        (lambda: _good_lines()[:10] + [b"@@@ 10"], "line 11: not '<base64 token>"),
        (lambda: _good_lines() + [b"YWJ 256"], "line 257: token is not base64"),
        (lambda: _good_lines() + [_line(300, b"ab")], "rank 256 is missing"),
        (lambda: _good_lines() + [_line(5, b"ab")], "line 257: rank 5 again"),
        (lambda: _good_lines() + [_line(256, b"\x07")], "line 257: token b'\\x07'"),
        (lambda: _good_lines()[1:] + [_line(0, b"ab")], "byte 0x00 has no rank"),
        (lambda: _good_lines() + [_line(256, b"x" * 2000)], "token of 2000 bytes"),
        (lambda: [], "no tokens"),
    ],
)
def test_a_corrupted_rank_file_is_refused_naming_the_problem(lines, message):
    with pytest.raises(TiktokenFileError, match=re.escape(message)):
        parse_ranks(b"\n".join(lines()) + b"\n")


def test_an_unknown_tokenizer_is_refused_by_name():
    model = tiktoken_model_bytes(trained_ranks())
    config = kimi_tokenizer_config(len(trained_ranks()))
    config["tokenizer_class"] = "OtherTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_other.OtherTokenizer", None]}
    with pytest.raises(UnknownTokenizerError, match="'OtherTokenizer' from"):
        convert(model, config)


def test_a_special_id_outside_the_reserved_block_is_refused():
    ranks = trained_ranks()
    config = kimi_tokenizer_config(len(ranks))
    config["added_tokens_decoder"]["7"] = {"content": "<|x|>", "special": True}
    with pytest.raises(ConversionError, match=r"\['7'\]: id 7 is outside"):
        convert(tiktoken_model_bytes(ranks), config)


def test_random_mixed_script_strings_match(pair):
    oracle, ours, _ = pair
    for text in random_texts(0, 2000):
        expected = oracle.encode(text, disallowed_special=())
        assert ours.encode(text, add_special_tokens=False).ids == expected, text


def test_the_pattern_splits_where_tiktokens_does():
    # Every substring of the texts up to 12 bytes is a token: a pre-token boundary
    # anywhere tiktoken draws none (or none where it draws one) changes the ids.
    ranks = substring_ranks()
    base = len(ranks)
    ours = convert(tiktoken_model_bytes(ranks), kimi_tokenizer_config(base))
    oracle = tiktoken.Encoding(
        "kimi-substrings",
        pat_str=KIMI.pattern,
        mergeable_ranks=ranks,
        special_tokens=kimi_special_ids(base),
    )
    for text in [*_texts(base).values(), *random_texts(1, 300)]:
        expected = oracle.encode(text, allowed_special="all")
        assert ours.encode(text, add_special_tokens=False).ids == expected, text
    # and the tokens do cross the pattern's boundaries: unsplit, texts take
    # fewer of them
    whole = tiktoken.Encoding(
        "whole", pat_str=r"[\s\S]+", mergeable_ranks=ranks, special_tokens={}
    )
    for kind in ("english", "chinese", "code", "whitespace", "digits"):
        text = SAMPLES[kind]
        assert len(whole.encode(text)) < len(oracle.encode(text)), kind
