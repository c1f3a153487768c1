"""Shared by the compression tests."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.gpuagent.conftest import DEMO_MODEL, TEST_CALIBRATION  # noqa: F401


def demo_layer_inputs(seed: int):
    """Layer 1 of the demo model and its inputs on random tokens: (layer, hidden,
    cos, sin), hidden [4, 48, hidden] from layer 0."""
    from gpuagent.engine.loader import load_model

    model = load_model(DEMO_MODEL)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (4, 48), generator=g)
    with torch.no_grad():
        cos, sin = model._rope(torch.arange(48))
        hidden = model.layers[0].forward_dense(model.embed_tokens(tokens), cos, sin)
    return model.layers[1], hidden, cos, sin


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
