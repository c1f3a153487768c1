"""The import of a published Kimi K2 / DeepSeek-V3 folder: the gate refuses the
source; the import's folder passes it, holds no code, loads in the engine with the
logits of a hand-cleaned copy, and its tokenizer (converted from tiktoken for
Kimi) gives tiktoken's ids through our engine and through transformers without
remote code. The source's code is never run. What the import cannot make safe is
refused by name, and a refused import leaves nothing behind."""

from __future__ import annotations

import errno
import json
import os

import pytest
import tiktoken
import torch

from gpuagent.engine.loader import load_model
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.integrity import ModelRejectedError, inspect_model
from gpuagent.models import carry_file
from gpuagent.models import import_published as importer
from gpuagent.models.import_published import (
    PROVENANCE_FILE,
    PublishedImportError,
    import_published,
)
from gpuagent.models.tiktoken_patterns import KIMI
from tests.gpuagent.models.published_fixture import (
    CODE_FILES,
    hand_cleaned,
    published_folder,
)
from tests.gpuagent.models.tiktoken_fixture import (
    SAMPLES,
    kimi_special_ids,
    trained_ranks,
)

MODEL_TYPES = ("kimi_k2", "deepseek_v3")


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """model_type -> (model_type, src, dst, marker, provenance), each made once."""
    made = {}

    def get(model_type):
        if model_type not in made:
            root = tmp_path_factory.mktemp(model_type)
            marker = root / "CODE-RAN"
            src = published_folder(root / "published", model_type, marker)
            provenance = import_published(src, root / "imported")
            made[model_type] = model_type, src, root / "imported", marker, provenance
        return made[model_type]

    return get


@pytest.fixture(params=MODEL_TYPES)
def imported(request, imports):
    return imports(request.param)


@pytest.fixture
def kimi(imports):
    return imports("kimi_k2")


def test_the_gate_refuses_the_published_folder(imported):
    _, src, _, _, _ = imported
    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(src)
    report = caught.value.report
    assert {"python-file", "remote-code-auto_map"} <= report.codes()
    # and points at the import
    for finding in (x for f in report.files for x in f.findings):
        if finding.code in ("python-file", "remote-code-auto_map"):
            assert "gpuagent.models.import_published SRC DST" in finding.detail


def test_the_import_passes_the_gate_without_code(imported):
    model_type, src, dst, marker, provenance = imported
    assert inspect_model(dst).ok
    names = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()}
    assert not any(n.endswith(".py") for n in names)
    assert not marker.exists(), "the source's code ran"
    for name in CODE_FILES[model_type]:
        assert "never loaded" in provenance.dropped[name]
    assert "figures/logo.png" in provenance.dropped
    # the config as published, less auto_map
    published = json.loads((src / "config.json").read_text())
    del published["auto_map"]
    assert json.loads((dst / "config.json").read_text()) == published
    # the shards are the source's files, linked (same filesystem here)
    for shard in (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ):
        assert os.stat(dst / shard).st_ino == os.stat(src / shard).st_ino
        assert provenance.carried[shard]["how"] == "hard-linked"
    recorded = json.loads((dst / PROVENANCE_FILE).read_text())
    assert recorded["source"] == str(src.resolve())
    assert set(recorded["carried"]) | set(recorded["rewritten"]) | set(
        recorded["produced"]
    ) == names - {PROVENANCE_FILE}


def test_the_import_loads_with_the_logits_of_a_hand_cleaned_copy(imported, tmp_path):
    _, src, dst, marker, _ = imported
    reference = load_model(hand_cleaned(src, tmp_path / "clean"))
    model = load_model(dst)
    tokens = torch.tensor([[1, 5, 200, 17, 99, 3, 250, 42]])
    with torch.no_grad():
        assert torch.equal(model.forward_dense(tokens), reference.forward_dense(tokens))
    assert not marker.exists()


def test_kimi_tokenizer_config_is_rewritten_for_a_fast_tokenizer(kimi):
    _, src, dst, _, provenance = kimi
    published = json.loads((src / "tokenizer_config.json").read_text())
    rewritten = json.loads((dst / "tokenizer_config.json").read_text())
    assert "auto_map" not in rewritten
    assert rewritten.pop("tokenizer_class") == "PreTrainedTokenizerFast"
    del published["auto_map"], published["tokenizer_class"]
    assert rewritten == published
    assert provenance.produced["tokenizer.json"]["from"] == "tiktoken.model"
    assert "tiktoken.model" in provenance.carried


def _kimi_oracle():
    ranks = trained_ranks()
    return tiktoken.Encoding(
        "kimi-test",
        pat_str=KIMI.pattern,
        mergeable_ranks=ranks,
        special_tokens=kimi_special_ids(len(ranks)),
    )


def test_kimi_tokenizer_gives_tiktokens_ids_in_the_engine_and_transformers(kimi):
    _, _, dst, marker, _ = kimi
    from transformers import AutoTokenizer

    oracle = _kimi_oracle()
    ours = load_tokenizer(dst)
    theirs = AutoTokenizer.from_pretrained(dst)  # no trust_remote_code
    reserved = f"{len(trained_ranks()) + 9}"
    text = "\n".join(SAMPLES.values()).replace("{r}", reserved)
    expected = oracle.encode(text, allowed_special="all")
    assert ours.encode(text) == expected
    assert theirs(text, add_special_tokens=False)["input_ids"] == expected
    assert ours.decode(expected) == text
    assert ours.eos_token_id == oracle.encode_single_token("[EOS]")
    assert theirs.eos_token_id == ours.eos_token_id
    assert not marker.exists()


def test_deepseek_tokenizer_is_carried_as_published(imports):
    _, src, dst, _, provenance = imports("deepseek_v3")
    assert "tokenizer.json" in provenance.carried and not provenance.produced
    assert (dst / "tokenizer.json").read_bytes() == (
        src / "tokenizer.json"
    ).read_bytes()
    assert load_tokenizer(dst).encode("hello") == load_tokenizer(src).encode("hello")


# ------------------------------------------------------------------ refusals


@pytest.fixture
def kimi_src(tmp_path):
    return published_folder(tmp_path / "published", "kimi_k2", tmp_path / "CODE-RAN")


def _refused(src, dst, match):
    with pytest.raises(PublishedImportError, match=match):
        import_published(src, dst)
    assert not dst.exists()
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_a_model_type_the_engine_does_not_implement_is_refused_by_name(
    kimi_src, tmp_path
):
    config = json.loads((kimi_src / "config.json").read_text())
    config["model_type"] = "kimi_linear"
    (kimi_src / "config.json").write_text(json.dumps(config))
    _refused(kimi_src, tmp_path / "out", "model_type 'kimi_linear' is not supported")


def test_a_pickle_is_refused_naming_the_file(kimi_src, tmp_path):
    (kimi_src / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    _refused(kimi_src, tmp_path / "out", r"pytorch_model\.bin: \[pickle-extension\]")


def test_an_unreviewed_custom_tokenizer_is_refused_by_name(kimi_src, tmp_path):
    config = json.loads((kimi_src / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "MyTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_my.MyTokenizer", None]}
    (kimi_src / "tokenizer_config.json").write_text(json.dumps(config))
    _refused(kimi_src, tmp_path / "out", "'MyTokenizer' from 'tokenization_my")


def test_a_corrupted_tiktoken_model_is_refused_naming_the_line(kimi_src, tmp_path):
    lines = (kimi_src / "tiktoken.model").read_bytes().splitlines()
    lines[300] = lines[300].split(b" ")[0] + b" 7"  # rank 7 twice
    (kimi_src / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    _refused(kimi_src, tmp_path / "out", "tiktoken.model line 301: rank 7 again")


def test_a_failure_while_writing_leaves_nothing(kimi_src, tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(importer, "_convert_tokenizer", failing)
    with pytest.raises(OSError, match="No space"):
        import_published(kimi_src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["published"]


def test_across_filesystems_the_weights_are_copied_and_checked(
    kimi_src, tmp_path, monkeypatch
):
    def cross_device(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(carry_file.os, "link", cross_device)
    provenance = import_published(kimi_src, tmp_path / "out")
    shard = "model-00001-of-00002.safetensors"
    assert provenance.carried[shard]["how"] == "copied"
    assert (tmp_path / "out" / shard).read_bytes() == (kimi_src / shard).read_bytes()
    assert os.stat(tmp_path / "out" / shard).st_ino != os.stat(kimi_src / shard).st_ino


def test_the_command_line(kimi_src, tmp_path, capsys):
    assert importer.main([str(kimi_src), str(tmp_path / "out")]) == 0
    assert "dropped" in capsys.readouterr().out
    assert importer.main([str(kimi_src), str(tmp_path / "out")]) == 1
    assert "exists" in capsys.readouterr().err


def test_the_markers_would_show_a_run_of_the_sources_code(kimi_src, tmp_path):
    # the checks above can fail: run as a program, the source's code leaves its mark
    import subprocess
    import sys

    subprocess.run([sys.executable, kimi_src / "tokenization_kimi.py"], check=True)
    assert (tmp_path / "CODE-RAN").read_text() == "ran"


def test_a_download_tools_hidden_state_is_dropped_unread(kimi_src, tmp_path):
    # huggingface-cli download --local-dir leaves .cache/huggingface/ behind
    state = kimi_src / ".cache" / "huggingface" / "download"
    state.mkdir(parents=True)
    (state / "config.json.metadata").write_text("abc\n")
    provenance = import_published(kimi_src, tmp_path / "out")
    assert "hidden path" in provenance.dropped[".cache"]
    assert not (tmp_path / "out" / ".cache").exists()
