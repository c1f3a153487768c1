"""Verify-on-load: `read_verified_files` hashes exactly the bytes it returns, so
a file swapped after verification never reaches the engine, and one swapped
before the load attempt is refused."""

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuagent.integrity import (
    ManifestDigestMismatchError,
    ManifestMismatchError,
    ModelRejectedError,
    SparseFileError,
    UnsafePathError,
    hash_model,
    read_inspected_files,
    read_verified_files,
    sign_model,
    verify_model,
)
from tests.gpuagent.integrity.builders import (
    DATA_FILES,
    RELEASE,
    ReadFromFile,
    make_sparse,
    raw_safetensors,
    shard_under_extras,
    upstream_sign,
    write_model,
)

SHARD1 = "model-00001-of-00002.safetensors"


def test_it_returns_the_verified_bytes_of_every_file(tmp_path):
    folder = write_model(tmp_path / "model", sharded=True)
    manifest = hash_model(folder)

    files = read_verified_files(folder, manifest.digest)

    assert sorted(files) == sorted(manifest.files())
    assert all(files[p] == (folder / p).read_bytes() for p in files)


@pytest.mark.parametrize(
    ("algorithm", "shard_size"), [("blake3", None), ("sha256", 64)]
)
def test_it_recomputes_the_hash_settings_named_by_the_digest(
    tmp_path, algorithm, shard_size
):
    folder = write_model(tmp_path / "model")
    manifest = hash_model(folder, algorithm, shard_size=shard_size)

    files = read_verified_files(folder, manifest.digest)

    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()


def test_it_refuses_a_file_swapped_between_verification_and_load(tmp_path, keys):
    folder = write_model(tmp_path / "model", sharded=True)
    result = sign_model(
        folder, folder / "model.sig", release=RELEASE, private_key=keys.private
    )
    assert verify_model(folder, folder / "model.sig", keys.policy()).ok
    # The swap: same size, other weights.
    other = write_model(tmp_path / "other", sharded=True, seed=5)
    shutil.copy(other / SHARD1, folder / SHARD1)

    with pytest.raises(ManifestDigestMismatchError):
        read_verified_files(folder, result.manifest.digest)
    with pytest.raises(ManifestMismatchError) as info:
        read_verified_files(
            folder,
            result.manifest.digest,
            signature_path=folder / "model.sig",
            policy=keys.policy(),
        )
    assert info.value.changed == [SHARD1]


def test_it_refuses_a_signature_for_another_manifest(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    sign_model(folder, folder / "model.sig", release=RELEASE, private_key=keys.private)
    approved = hash_model(write_model(tmp_path / "approved", seed=3)).digest

    with pytest.raises(ManifestDigestMismatchError):
        read_verified_files(
            folder, approved, signature_path=folder / "model.sig", policy=keys.policy()
        )


def test_it_refuses_a_planted_file_and_a_symlink(tmp_path):
    folder = write_model(tmp_path / "model")
    digest = hash_model(folder).digest
    (folder / "extra.json").write_text("{}")
    with pytest.raises(ManifestDigestMismatchError):
        read_verified_files(folder, digest)
    (folder / "extra.json").unlink()

    os.rename(folder / "config.json", tmp_path / "config.json")
    os.symlink(tmp_path / "config.json", folder / "config.json")
    with pytest.raises(UnsafePathError):
        read_verified_files(folder, digest)


def test_it_refuses_a_symlinked_subfolder_and_a_fifo(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "sub").mkdir()
    (folder / "sub" / "a.txt").write_text("a")
    digest = hash_model(folder).digest
    shutil.move(folder / "sub", tmp_path / "sub")
    os.symlink(tmp_path / "sub", folder / "sub")
    with pytest.raises(UnsafePathError, match="sub"):
        read_verified_files(folder, digest)
    os.unlink(folder / "sub")
    os.mkfifo(folder / "pipe")  # must be refused, not block the reader
    with pytest.raises(UnsafePathError, match="pipe"):
        read_verified_files(folder, digest)


# --- with the engine's loader ----------------------------------------------


def write_llama(folder: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    from gpuagent.engine.loader import hf_name
    from gpuagent.engine.model import LlamaConfig, Transformer

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = Transformer(config)
    folder.mkdir(parents=True)
    state = {hf_name(n): t.contiguous() for n, t in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config.to_hf_config()))
    return folder


def test_it_loads_only_the_verified_bytes_into_the_engine(tmp_path):
    import torch

    from gpuagent.engine.loader import load_model

    folder = write_llama(tmp_path / "llama", seed=0)
    approved = load_model(shutil.copytree(folder, tmp_path / "approved"))
    swapped = write_llama(tmp_path / "swapped", seed=1)
    digest = hash_model(folder).digest

    files = read_verified_files(folder, digest)
    # Swapped after verification: the engine still gets what was verified.
    shutil.copy(swapped / "model.safetensors", folder / "model.safetensors")
    model = load_model(folder, files=files)
    from_disk = load_model(folder)

    assert torch.equal(model.embed_tokens.weight, approved.embed_tokens.weight)
    assert not torch.equal(model.embed_tokens.weight, from_disk.embed_tokens.weight)
    with pytest.raises(ManifestDigestMismatchError):  # the next load refuses
        read_verified_files(folder, digest)


def test_it_lets_the_engine_refuse_files_that_were_not_verified(tmp_path):
    from gpuagent.engine.loader import ModelLoadError, load_model

    folder = write_llama(tmp_path / "llama", seed=0)
    files = read_verified_files(folder, hash_model(folder).digest)
    del files["model.safetensors"]

    with pytest.raises(ModelLoadError):
        load_model(folder, files=files)


# --- strict checks at load, on the loaded bytes ------------------------------


def test_it_refuses_an_approved_shard_that_is_not_safetensors_by_name(tmp_path):
    # safetensors itself takes this duplicate-name file, and the engine would load
    # any shard name the index gives: the digest alone would let it through.
    entry = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    entry_json = json.dumps(entry)
    header = f'{{"w": {entry_json}, "w": {entry_json}}}'
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.dat").write_bytes(raw_safetensors(header, b"\0" * 4))
    index = {"weight_map": {"w": "weights.dat"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text('{"model_type": "llama"}')

    with pytest.raises(ModelRejectedError) as refused:  # *.dat named: read
        read_verified_files(folder, hash_model(folder).digest, policy=DATA_FILES)

    assert "index-shard-not-safetensors" in refused.value.report.codes()


def test_it_refuses_code_files_among_the_approved_files(tmp_path):
    # A digest approved without an inspection (or under an older policy).
    folder = write_model(tmp_path / "model")
    (folder / "modeling_llama.py").write_text("import os\n")

    with pytest.raises(ModelRejectedError) as refused:
        read_verified_files(folder, hash_model(folder).digest)

    assert refused.value.report.codes() == {"python-file"}


def test_it_checks_the_bytes_it_returns_under_an_approved_digest(tmp_path):
    # A digest taken of a duplicate-key config.json (json.loads: last one wins).
    folder = write_model(tmp_path / "model")
    (folder / "config.json").write_text('{"model_type": "llama", "model_type": "x"}')

    with pytest.raises(ModelRejectedError) as refused:
        read_verified_files(folder, hash_model(folder).digest)

    assert refused.value.report.codes() == {"json-duplicate-key"}
    rejected = [f.path for f in refused.value.report.files if f.verdict != "ok"]
    assert rejected == ["config.json"]


def test_it_checks_the_bytes_it_returns_not_the_folder_inspected(tmp_path, monkeypatch):
    # Unpinned: the folder passes inspection, then a duplicate-key config.json is
    # swapped in before the read. The bytes that would reach the engine are refused.
    import gpuagent.integrity.verified_load as verified_load

    folder = write_model(tmp_path / "model")
    real_inspect = verified_load.inspect_model

    def inspect_then_swap(*args, **kwargs):
        report = real_inspect(*args, **kwargs)
        (folder / "config.json").write_text('{"model_type": "llama", "model_type": 1}')
        return report

    monkeypatch.setattr(verified_load, "inspect_model", inspect_then_swap)

    with pytest.raises(ModelRejectedError) as refused:
        read_inspected_files(folder)

    assert refused.value.report.codes() == {"json-duplicate-key"}


def test_it_reads_an_unpinned_folder_only_after_inspecting_it(tmp_path):
    folder = write_model(tmp_path / "model", sharded=True)

    files, digest = read_inspected_files(folder)

    assert digest == hash_model(folder).digest
    assert all(files[p] == (folder / p).read_bytes() for p in files)
    assert sorted(files) == sorted(hash_model(folder).files())
    os.symlink("/etc/passwd", folder / "special_tokens_map.json")
    with pytest.raises(ModelRejectedError) as refused:
        read_inspected_files(folder)
    assert "symlink-escapes" in refused.value.report.codes()


def test_it_does_not_inspect_what_the_manifest_ignores(tmp_path):
    # The signature's name is left out of the manifest: not read, not checked.
    folder = write_model(tmp_path / "model")
    (folder / "model.sig").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    digest = hash_model(folder, ignore_paths=("model.sig",)).digest

    files = read_verified_files(folder, digest)

    assert "model.sig" not in files
    assert "config.json" in files


# --- refused before reading -----------------------------------------------------


@pytest.fixture
def reads(monkeypatch):
    """The paths verify-on-load reads (`.paths`); reading one in `.refused`
    aborts the test instead (a 64 GiB sparse file, read into memory)."""
    from gpuagent.integrity import verified_load

    real_read = verified_load._read_file
    reads = SimpleNamespace(paths=[], refused=set())

    def spy(root_fd, path):
        if path in reads.refused:
            raise ReadFromFile(f"{path} was read")
        reads.paths.append(path)
        return real_read(root_fd, path)

    monkeypatch.setattr(verified_load, "_read_file", spy)
    return reads


@pytest.mark.parametrize(
    ("name", "error", "code"),
    [
        ("model.safetensors", SparseFileError, "sparse-file"),
        ("weights.xyz", ModelRejectedError, "file-not-allowed"),
        ("config.json", ModelRejectedError, "json-too-large"),
    ],
    ids=["sparse", "by-name", "by-size"],
)
def test_it_refuses_a_file_by_name_size_or_holes_before_reading_any(
    tmp_path, reads, name, error, code
):
    folder = write_model(tmp_path / "model")
    digest = hash_model(folder).digest
    make_sparse(folder / name, 64 << 30)
    reads.refused.add(name)

    with pytest.raises(error) as caught:
        read_verified_files(folder, digest)

    refused = caught.value
    codes = refused.report.codes() if error is ModelRejectedError else {refused.code}
    assert codes == {code}
    assert name in str(refused)
    assert reads.paths == []


def test_it_refuses_a_signed_index_naming_a_shard_the_signature_left_out(
    tmp_path, keys
):
    folder = write_model(tmp_path / "model", sharded=True)
    shard_under_extras(folder)
    signature = tmp_path / "publisher.sig"
    upstream_sign(folder, signature, keys.private, ignore=["extras"])
    policy = keys.policy(release=None, extra_ignorable_paths=("extras",))
    digest = hash_model(folder, ignore_paths=("extras",)).digest

    with pytest.raises(ModelRejectedError) as caught:
        read_verified_files(folder, digest, signature_path=signature, policy=policy)

    assert caught.value.report.codes() == {"index-shard-not-signed"}


def test_it_refuses_a_bom_in_the_json_it_returns(tmp_path):
    # The engine's loader parses bytes with json.loads, which takes a BOM;
    # transformers does not: the gate refuses it before the engine sees it.
    folder = write_model(tmp_path / "model")
    config = folder / "config.json"
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())

    with pytest.raises(ModelRejectedError) as caught:
        read_verified_files(folder, hash_model(folder).digest)

    assert caught.value.report.codes() == {"json-utf8-bom"}
