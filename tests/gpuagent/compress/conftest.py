"""Shared by the compression tests."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpuagent.compress import compress

DEMO_MODEL = Path(__file__).resolve().parents[3] / "gpuagent" / "engine" / "demo_model"
# Small calibration for the tests: (sequences, tokens each).
TEST_CALIBRATION = (6, 64)

RECIPES = {
    "w8a16": {"weights": "w8a16", "kv_cache_dtype": "fp8"},
    "w4a16-g128": {"weights": "w4a16-g128", "kv_cache_dtype": "bf16"},
    "fp8": {"weights": "fp8", "kv_cache_dtype": "bf16"},
    "fp8-gptq": {"weights": "fp8", "kv_cache_dtype": "bf16", "method": "gptq"},
    "w8a16-gptq-mse": {
        "weights": "w8a16",
        "kv_cache_dtype": "bf16",
        "method": "gptq",
        "observer": "mse",
    },
    "w4a16-g64-signround": {
        "weights": "w4a16-g64",
        "kv_cache_dtype": "bf16",
        "method": "signround",
    },
    "w4a16-g64-asym-gptq": {
        "weights": "w4a16-g64",
        "kv_cache_dtype": "bf16",
        "method": "gptq",
        "symmetric": False,
    },
}


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


@pytest.fixture(scope="session")
def compressed_demo(tmp_path_factory) -> dict[str, Path]:
    """The demo model compressed under each recipe of RECIPES (once per session)."""
    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for name, recipe in RECIPES.items():
        out[name] = root / name
        compress(DEMO_MODEL, recipe, out[name], calibration_size=TEST_CALIBRATION)
    return out


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
