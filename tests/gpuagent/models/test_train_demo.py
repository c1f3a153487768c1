"""`train_demo`: training is a function of the seed, and a run that would replace the
shipped model with one trained on a different corpus is refused before it trains.

The committed demo folder is only read here; runs write to tmp_path.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from gpuagent.engine.model import LlamaConfig
from gpuagent.models import train_demo

TINY = LlamaConfig(
    vocab_size=train_demo.BYTE_VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    bos_token_id=train_demo.BOS_ID,
    eos_token_id=train_demo.EOS_ID,
)


@pytest.fixture(autouse=True)
def restore_torch_globals():
    """`train` seeds torch's global generator and turns deterministic algorithms on
    for the process; put both back for the tests that run after these."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        yield
    torch.use_deterministic_algorithms(deterministic)


def fake_committed_dir(path: Path, report: dict) -> Path:
    """A stand-in for the committed demo folder: `report` and a marker weights file."""
    path.mkdir(parents=True)
    (path / "training_report.json").write_text(json.dumps(report))
    (path / "model.safetensors").write_bytes(b"the shipped weights")
    return path


def with_changed_digest(report: dict, domain: str) -> dict:
    changed = copy.deepcopy(report)
    changed["corpus_sha256"][domain] = "0" * 64
    return changed


# --------------------------------------------------------------------- training


def tiny_run(corpus, seed: int):
    model, stats = train_demo.train(
        seed,
        steps=3,
        batch=2,
        seq_len=16,
        peak_lr=3e-3,
        log_every=10,
        corpus=corpus,
        config=TINY,
    )
    return model.state_dict(), stats


def test_training_is_a_function_of_the_seed(corpus, committed_report):
    first, stats = tiny_run(corpus, seed=0)
    again, _ = tiny_run(corpus, seed=0)
    other, _ = tiny_run(corpus, seed=1)

    assert first.keys() == again.keys() == other.keys()
    for name in first:
        assert torch.equal(first[name], again[name]), name
    differing = [n for n in first if not torch.equal(first[n], other[n])]
    assert differing, "seed 1 trained the same weights as seed 0"
    assert stats["corpus_sha256"] == committed_report["corpus_sha256"]
    assert stats["train_tokens_seen"] == 3 * 2 * 16


# ------------------------------------------------------------------ corpus check


def test_the_check_passes_the_committed_corpus_even_into_the_committed_folder(
    corpus, committed_report, capsys
):
    differing = train_demo.check_corpus(
        corpus, committed_report, train_demo.COMMITTED_DIR
    )

    assert differing == []
    assert "!!" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("domain", "depends_on"),
    [
        ("code", "Python version"),
        ("english", "Python version"),
        ("korean", "Korean catalogs"),
    ],
)
def test_it_refuses_to_overwrite_the_committed_model_when_a_corpus_part_differs(
    corpus, committed_report, tmp_path, capsys, domain, depends_on
):
    committed_dir = fake_committed_dir(
        tmp_path / "demo_model", with_changed_digest(committed_report, domain)
    )
    report = train_demo.read_committed_report(committed_dir)

    with pytest.raises(SystemExit) as stopped:
        train_demo.check_corpus(corpus, report, committed_dir, False, committed_dir)

    assert stopped.value.code == train_demo.CORPUS_MISMATCH_EXIT != 0
    err = " ".join(capsys.readouterr().err.replace("!!", " ").split())
    assert f"in: {domain}." in err
    assert f"- {domain} depends on {train_demo.CORPUS_DEPENDS_ON[domain]}" in err
    assert depends_on in err
    assert "Refusing to overwrite" in err
    assert "--allow-different-corpus" in err


def test_it_only_warns_when_the_output_is_elsewhere_or_the_override_is_given(
    corpus, committed_report, tmp_path, capsys
):
    report = with_changed_digest(committed_report, "korean")
    committed_dir = fake_committed_dir(tmp_path / "demo_model", report)

    elsewhere = train_demo.check_corpus(
        corpus, report, tmp_path / "elsewhere", False, committed_dir
    )
    first = capsys.readouterr().err
    overridden = train_demo.check_corpus(
        corpus, report, committed_dir, True, committed_dir
    )
    second = capsys.readouterr().err

    assert elsewhere == overridden == ["korean"]
    for err in (first, second):
        assert "differs" in err and "Training anyway" in err
        assert "Refusing" not in err


def test_main_stops_before_training_and_leaves_the_committed_folder_alone(
    corpus, committed_report, tmp_path, monkeypatch, capsys
):
    committed_dir = fake_committed_dir(
        tmp_path / "demo_model", with_changed_digest(committed_report, "korean")
    )
    before = {p.name: p.read_bytes() for p in committed_dir.iterdir()}
    monkeypatch.setattr(train_demo, "COMMITTED_DIR", committed_dir)
    monkeypatch.setattr(train_demo, "build_corpus", lambda: corpus)

    def no_training(*args, **kwargs):
        raise AssertionError("trained despite the corpus mismatch")

    monkeypatch.setattr(train_demo, "train", no_training)

    with pytest.raises(SystemExit) as stopped:
        train_demo.main(["--out", str(committed_dir), "--steps", "2"])

    assert stopped.value.code == train_demo.CORPUS_MISMATCH_EXIT
    assert {p.name: p.read_bytes() for p in committed_dir.iterdir()} == before
    assert "korean" in capsys.readouterr().err


def test_main_warns_and_trains_into_another_folder(
    corpus, committed_report, tmp_path, monkeypatch, capsys
):
    committed_dir = fake_committed_dir(
        tmp_path / "demo_model", with_changed_digest(committed_report, "code")
    )
    monkeypatch.setattr(train_demo, "COMMITTED_DIR", committed_dir)
    monkeypatch.setattr(train_demo, "build_corpus", lambda: corpus)
    out = tmp_path / "elsewhere"

    train_demo.main(
        ["--out", str(out), "--steps", "2", "--batch", "1", "--seq-len", "16"]
        + ["--eval-bytes", "64"]
    )

    err = capsys.readouterr().err
    assert "in: code." in err and "Training anyway" in err
    written = json.loads((out / "training_report.json").read_text())
    assert written["corpus_sha256"] == committed_report["corpus_sha256"]
    assert written["corpus_sources"] == corpus.sources
    assert written["steps"] == 2
    assert (out / "model.safetensors").exists()
