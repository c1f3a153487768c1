from pathlib import Path

import pytest

from gpuagent.compress import compress

DEMO_MODEL = Path(__file__).resolve().parents[3] / "gpuagent" / "engine" / "demo_model"
# Small calibration for the tests: (sequences, tokens each).
TEST_CALIBRATION = (6, 64)

RECIPES = {
    "w8a16": {"weights": "w8a16", "kv_cache_dtype": "fp8"},
    "w4a16-g128": {"weights": "w4a16-g128", "kv_cache_dtype": "bf16"},
    "fp8": {"weights": "fp8", "kv_cache_dtype": "bf16"},
    "w4a16-g64-asym-gptq": {
        "weights": "w4a16-g64",
        "kv_cache_dtype": "bf16",
        "method": "gptq",
        "symmetric": False,
    },
}


@pytest.fixture(scope="session")
def compressed_demo(tmp_path_factory) -> dict[str, Path]:
    """The demo model compressed under each recipe of RECIPES (once per session)."""
    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for name, recipe in RECIPES.items():
        out[name] = root / name
        compress(DEMO_MODEL, recipe, out[name], calibration_size=TEST_CALIBRATION)
    return out
