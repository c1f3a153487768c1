"""The engine loads a lossless folder to the very weights of its source; the
manifest covers the compressed bytes, the recorded digests the decoded ones."""

import shutil

import pytest
import torch

from gpuagent.engine.loader import ModelLoadError, load_model
from gpuagent.integrity import read_inspected_files, read_verified_files
from gpuagent.integrity.errors import ManifestDigestMismatchError
from gpuagent.lossless.container import CONTAINER_FILE, compress_folder

TOKENS = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]])


@pytest.fixture
def folders(tmp_path, bf16_demo_folder):
    compress_folder(bf16_demo_folder, tmp_path / "lossless")
    return bf16_demo_folder, tmp_path / "lossless"


def _logits(model):
    with torch.no_grad():
        return model.forward_dense(TOKENS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_it_loads_a_lossless_folder_to_identical_logits(folders, dtype):
    source, lossless = folders

    original = load_model(source, dtype=dtype)
    decoded = load_model(lossless, dtype=dtype)

    for name, p in original.state_dict().items():
        assert torch.equal(decoded.state_dict()[name], p), name
    assert torch.equal(_logits(decoded), _logits(original))


def test_it_loads_the_verified_bytes_and_the_manifest_covers_the_container(folders):
    source, lossless = folders
    files, digest = read_inspected_files(lossless)

    model = load_model(lossless, dtype=torch.bfloat16, files=files)

    assert CONTAINER_FILE in files
    assert torch.equal(
        _logits(model), _logits(load_model(source, dtype=torch.bfloat16))
    )
    container = bytearray((lossless / CONTAINER_FILE).read_bytes())
    container[-1] ^= 1
    (lossless / CONTAINER_FILE).write_bytes(bytes(container))
    with pytest.raises(ManifestDigestMismatchError):
        read_verified_files(lossless, digest)


def test_it_refuses_a_corrupted_container_naming_it(folders):
    _, lossless = folders
    container = bytearray((lossless / CONTAINER_FILE).read_bytes())
    container[-1] ^= 1  # in the last plane: model.norm.weight's rest
    (lossless / CONTAINER_FILE).write_bytes(bytes(container))

    with pytest.raises(ModelLoadError, match=f"{CONTAINER_FILE}: model.norm.weight:"):
        load_model(lossless)


def test_it_refuses_a_folder_with_both_the_container_and_plain_weights(folders):
    source, lossless = folders
    shutil.copy(source / "model.safetensors", lossless / "model.safetensors")

    with pytest.raises(ModelLoadError, match="both"):
        load_model(lossless)
