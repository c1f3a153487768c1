"""The engine tests' tiny random models, for the engine bench's tests (the
compressed demo folders come from tests/gpuagent/conftest.py)."""

from tests.gpuagent.engine.conftest import (  # noqa: F401
    tiny_model_and_tokenizer,
    tiny_model_dir,
)
