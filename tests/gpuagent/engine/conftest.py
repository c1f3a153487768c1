"""Shared fixtures for the engine tests: tiny random Llama folders in Hugging Face
format (written by `transformers` itself) with the byte-level tokenizer.

`make_tiny_model_dir(path, **overrides)` builds one anywhere; the session fixtures
`tiny_model_dir` (GQA, untied) and `tiny_tied_model_dir` (MHA, tied embeddings) are
built once per test session; `demo_w4a16` is the demo model compressed w4a16-g128
by the project's pipeline, once per session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 264,  # the byte tokenizer's 256 bytes + 8 specials
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "bos_token_id": 256,  # <|bos|>
    "eos_token_id": 257,  # <|eos|>
    "tie_word_embeddings": False,
    # Larger than HF's 0.02 so random logits are peaked: greedy argmax then doesn't
    # hinge on float rounding differences between batch shapes.
    "initializer_range": 0.2,
}


def make_tiny_model_dir(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny LlamaForCausalLM (safetensors) + byte tokenizer to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpuagent.engine.tokenizer import save_byte_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_CONFIG, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def demo_w4a16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpuagent.compress import compress
    from tests.gpuagent.conftest import DEMO_MODEL

    out = tmp_path_factory.mktemp("demo-w4a16") / "w4a16-g128"
    compress(DEMO_MODEL, {"weights": "w4a16-g128", "kv_cache_dtype": "bf16"}, out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random tiny GQA model (2 heads, 1 KV head, head_dim 32), untied."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random tiny MHA model (2 heads, head_dim 64) with tied embeddings."""
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny_llama_tied"),
        seed=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        hidden_size=128,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir: Path):
    """The `tiny_model_dir` model loaded by our loader, and its tokenizer."""
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


@pytest.fixture
def make_engine(tiny_model_and_tokenizer):
    """Build an `LLMEngine` over the shared tiny model: make_engine(**engine_kwargs)."""
    from gpuagent.engine.engine import LLMEngine

    model, tokenizer = tiny_model_and_tokenizer

    def build(**kwargs: Any) -> LLMEngine:
        kwargs.setdefault("num_blocks", 64)
        kwargs.setdefault("block_size", 4)
        return LLMEngine(model, tokenizer, **kwargs)

    return build
