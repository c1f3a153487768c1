"""Shared by the lossless coding tests."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.gpuagent.conftest import DEMO_MODEL


@pytest.fixture
def bf16_demo_folder(tmp_path):
    """A copy of the demo model with its weights cast to bf16."""
    folder = tmp_path / "bf16"
    shutil.copytree(DEMO_MODEL, folder)
    tensors = load_file(folder / "model.safetensors")
    save_file(
        {n: t.to(torch.bfloat16) for n, t in tensors.items()},
        folder / "model.safetensors",
    )
    return folder
