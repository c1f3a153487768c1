"""Shared by the agent's tests (engine, models, evaluate, loadtest, compress and the
benches)."""

from pathlib import Path

import pytest
import torch

DEMO_MODEL = Path(__file__).resolve().parents[2] / "gpuagent" / "engine" / "demo_model"
# Small calibration for the tests: (sequences, tokens each).
TEST_CALIBRATION = (6, 64)
# What `compressed_demo` compresses the demo model under (the compression tests and
# the compression bench's read the same folders).
COMPRESSED_DEMO_RECIPES = {
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


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Run the agent's tests on one intra-op thread: the tiny matmuls here gain
    nothing from more, and on a shared CPU extra threads spin-wait and run 10-40x
    slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def compressed_demo(tmp_path_factory) -> dict[str, Path]:
    """The demo model compressed under each recipe of COMPRESSED_DEMO_RECIPES (once
    per session)."""
    from gpuagent.compress import compress

    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for name, recipe in COMPRESSED_DEMO_RECIPES.items():
        out[name] = root / name
        compress(DEMO_MODEL, recipe, out[name], calibration_size=TEST_CALIBRATION)
    return out
