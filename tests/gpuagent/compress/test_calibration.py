"""Calibration sequences: distinct windows of each domain's own documents."""

import re

from gpuagent.compress.calibration import calibration_sequences, calibration_texts
from gpuagent.engine.tokenizer import load_tokenizer

from .conftest import DEMO_MODEL

HANGUL = re.compile("[\uac00-\ud7a3]")


def test_each_domain_draws_from_its_own_documents():
    english, code, korean = calibration_texts(32)
    assert english and code and korean
    assert not any(HANGUL.search(doc) for doc in english + code)
    assert all(HANGUL.search(doc) for doc in korean)
    assert sum("def " in doc or "import " in doc for doc in code) > len(code) / 2


def test_sequences_are_distinct_windows_in_domain_turns():
    """96 sequences of 256 tokens from 3 domains, where Korean has only a few
    documents: every sequence different, every third one Korean text."""
    tokenizer = load_tokenizer(DEMO_MODEL)
    korean_docs = len(calibration_texts(32)[2])
    assert korean_docs < 32  # the case the windows are for
    sequences = calibration_sequences(tokenizer, 96, 256)
    assert len(sequences) == 96
    assert all(len(s) == 256 for s in sequences)
    assert len({tuple(s) for s in sequences}) == 96
    for i, ids in enumerate(sequences):
        text = tokenizer.decode(ids)
        assert bool(HANGUL.search(text)) == (i % 3 == 2), (i, text[:80])
