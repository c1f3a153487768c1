"""`corpus`: the corpus this machine builds is the one the shipped demo model was
trained on, and its fast encoder gives the byte tokenizer's ids."""

from __future__ import annotations

import pytest

from gpuagent.engine.tokenizer import SPECIAL_TOKENS, build_byte_tokenizer
from gpuagent.models.corpus import (
    DOMAINS,
    SHIPPED_CORPUS_SOURCES,
    corpus_digests,
    django_korean_catalogs,
    encode_bytes,
    korean_pairs,
    korean_training_text,
)


def test_this_machine_builds_the_corpus_the_shipped_model_was_trained_on(
    corpus, committed_report
):
    tokens = {d: len(corpus.ids[d]) for d in DOMAINS}

    assert corpus_digests(corpus.ids) == committed_report["corpus_sha256"]
    assert tokens == committed_report["train_tokens_per_domain"]
    assert len(corpus.korean_catalogs) == committed_report["korean_catalogs"]
    # what the mismatch message quotes for the shipped report (which predates
    # corpus_sources): the counts that reproduce its digests
    shipped = SHIPPED_CORPUS_SOURCES
    for key in ("code_files", "english_topics", "korean_catalogs"):
        assert corpus.sources[key] == shipped[key], key


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain ascii\n",
        "안녕하세요 \r\n\t\x00\x7f\ufffd 🙂",
        "".join(SPECIAL_TOKENS),
        "<|bos|<|eos|>|>",  # a cut-off special right before a whole one
        "<|<|user|>\n<|reserved_1|x<|reserved_0|>",
        "<|bos|>\n<|user|>\nHello<|eos|>\n<|assistant|>\n안녕<|eos|>\n",
    ],
)
def test_the_fast_encoder_gives_the_byte_tokenizers_ids(text):
    expected = build_byte_tokenizer().encode(text, add_special_tokens=False).ids

    assert encode_bytes(text).tolist() == expected


def test_the_fast_encoder_gives_the_byte_tokenizers_ids_on_the_korean_chat_corpus():
    catalogs = django_korean_catalogs()
    pairs = korean_pairs(catalogs, heldout=False)
    text = korean_training_text(pairs)[:100_000]
    assert "<|assistant|>" in text

    expected = build_byte_tokenizer().encode(text, add_special_tokens=False).ids

    assert encode_bytes(text).tolist() == expected
