"""Streamed verify-on-load (`open_inspected`, `open_verified`): the digests
`read_inspected_files` and `hash_model` give, the same tensors, the same
refusals, and a tensor changed on disk after the folder was checked is refused,
never used."""

import shutil

import numpy as np
import pytest
import torch

from gpuagent.integrity import (
    ManifestDigestMismatchError,
    ManifestMismatchError,
    ModelRejectedError,
    hash_model,
    read_inspected_files,
    sign_model,
)
from gpuagent.integrity.streamed_load import (
    TensorChangedError,
    open_inspected,
    open_verified,
)
from tests.gpuagent.integrity.builders import RELEASE, raw_safetensors, write_model

SHARD1 = "model-00001-of-00002.safetensors"


@pytest.mark.parametrize("sharded", [False, True])
def test_it_gives_the_in_memory_digest_and_tensors(tmp_path, sharded):
    from safetensors.numpy import load

    folder = write_model(tmp_path / "model", sharded=sharded)
    files, digest = read_inspected_files(folder)

    with open_inspected(folder) as model:
        assert model.digest == digest
        assert model.files == {
            n: b for n, b in files.items() if not n.endswith(".safetensors")
        }
        expected = {}
        for name, data in files.items():
            if name.endswith(".safetensors"):
                expected |= load(data)
        assert set(model.refs) == set(expected)
        for name, array in expected.items():
            assert np.array_equal(model.tensor(name).numpy(), array)


def test_it_refuses_a_tensor_changed_after_the_check(tmp_path):
    folder = write_model(tmp_path / "model", sharded=True)
    with open_inspected(folder) as model:
        name = next(n for n, r in model.refs.items() if r.file == SHARD1)
        other = next(n for n, r in model.refs.items() if r.file != SHARD1)
        ref = model.refs[name]
        with open(folder / SHARD1, "r+b") as f:  # in place: the same inode
            f.seek(ref.start)
            byte = f.read(1)
            f.seek(ref.start)
            f.write(bytes([byte[0] ^ 1]))

        with pytest.raises(TensorChangedError, match=name):
            model.tensor(name)
        assert isinstance(model.tensor(other), torch.Tensor)  # untouched file


def test_it_refuses_a_malformed_header_as_the_in_memory_reader_does(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(
        raw_safetensors('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}')
        + b"\0" * 4
    )

    with pytest.raises(ModelRejectedError):
        read_inspected_files(folder)
    with pytest.raises(ModelRejectedError):
        open_inspected(folder)


@pytest.mark.parametrize(
    ("algorithm", "shard_size"), [("sha256", None), ("blake3", None), ("sha256", 64)]
)
def test_open_verified_recomputes_the_digest_it_is_given(
    tmp_path, algorithm, shard_size, monkeypatch
):
    import gpuagent.integrity.streamed_load as streamed_load

    monkeypatch.setattr(streamed_load, "CHUNK_BYTES", 100)  # shards across chunks
    folder = write_model(tmp_path / "model", sharded=True)
    manifest = hash_model(folder, algorithm, shard_size=shard_size)

    with open_verified(folder, manifest.digest) as model:
        assert model.digest == manifest.digest
        name = sorted(model.refs)[0]
        assert model.tensor(name).numel() > 0
    other = hash_model(write_model(tmp_path / "other", seed=3), algorithm).digest
    with pytest.raises(ManifestDigestMismatchError):
        open_verified(folder, other)


def test_open_verified_names_the_file_swapped_after_signing(tmp_path, keys):
    folder = write_model(tmp_path / "model", sharded=True)
    result = sign_model(
        folder, folder / "model.sig", release=RELEASE, private_key=keys.private
    )
    with open_verified(
        folder,
        result.manifest.digest,
        signature_path=folder / "model.sig",
        policy=keys.policy(),
    ) as model:
        assert model.digest == result.manifest.digest
    other = write_model(tmp_path / "other", sharded=True, seed=5)
    shutil.copy(other / SHARD1, folder / SHARD1)

    with pytest.raises(ManifestMismatchError) as info:
        open_verified(
            folder,
            result.manifest.digest,
            signature_path=folder / "model.sig",
            policy=keys.policy(),
        )
    assert info.value.changed == [SHARD1]
