"""The held-out long passages: every slice has several, each is listed in
SOURCES.md, none shares a line with the tuning and calibration text, and each is
at least 2048 SmolLM2 tokens (the long-text bench scores them whole)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuagent.engine.kv_calibration import CALIBRATION_TEXTS
from gpuagent.evaluate.evalsets import (
    DATA_DIR,
    HELDOUT_DIR,
    TEXT_SLICES,
    load_heldout_passages,
)

SMOLLM2 = Path(__file__).resolve().parents[3] / "var" / "models" / "smollm2-135m"


def long_lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= 40}


def test_every_slice_has_several_passages_each_with_its_source():
    passages = load_heldout_passages()
    sources = (HELDOUT_DIR / "SOURCES.md").read_text("utf-8")

    assert [p.slice for p in passages] == sorted(
        (p.slice for p in passages), key=TEXT_SLICES.index
    )
    for name in TEXT_SLICES:
        assert sum(p.slice == name for p in passages) >= 2, name
    for p in passages:
        assert f"| {p.slice}-{p.name}.txt |" in sources


def test_no_passage_shares_a_line_with_the_tuning_or_calibration_text():
    tuning = "\n".join(
        [path.read_text("utf-8") for path in sorted(DATA_DIR.iterdir())]
        + list(CALIBRATION_TEXTS)
    )
    seen = long_lines(tuning)

    for p in load_heldout_passages():
        assert not long_lines(p.text) & seen, p.name


def test_a_file_named_outside_the_slices_is_refused(tmp_path):
    (tmp_path / "poetry-sonnets.txt").write_text("x", "utf-8")

    with pytest.raises(ValueError, match="poetry-sonnets.txt"):
        load_heldout_passages(tmp_path)


@pytest.mark.skipif(
    not (SMOLLM2 / "tokenizer.json").exists(), reason="needs var/models/smollm2-135m"
)
def test_each_passage_is_at_least_2048_smollm2_tokens():
    from gpuagent.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2)

    for p in load_heldout_passages():
        assert len(tokenizer.encode_prompt(p.text)) >= 2048, p.name
