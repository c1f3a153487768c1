"""On the real model, SmolLM2-135M, every CPU decode speed path gives the greedy
tokens of its reference path: layers on one thread at decode vs torch's threads,
int4 q/k/v and gate/up fused through the prepared kernel vs the torch reference,
fp8 dequantized once vs per call."""

from __future__ import annotations

import pytest
import torch

from gpuagent.compress.pipeline import compress
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.engine.weights import QuantLinear, use_cpu_kernels
from kernels import int4_cpu

PROMPT = "def fibonacci(n):\n    "
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(folder) -> LLMEngine:
    return LLMEngine(
        load_model(folder), load_tokenizer(folder), num_blocks=16, max_num_seqs=1
    )


def _tokens(engine: LLMEngine) -> list[int]:
    return engine.generate([PROMPT], GREEDY)[0].token_ids


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_decode_on_one_thread_gives_the_tokens_of_all_threads(
    real_model_dir, two_threads
):
    engine = _engine(real_model_dir)
    narrow = _tokens(engine)
    engine.model.small_step_threads = None
    assert _tokens(engine) == narrow


@pytest.mark.parametrize("weights", ["w4a16-g128", "fp8"])
def test_compressed_decode_paths_give_the_reference_tokens(
    real_model_dir, tmp_path, monkeypatch, weights
):
    folder = tmp_path / weights
    compress(real_model_dir, {"weights": weights, "kv_cache_dtype": "bf16"}, folder)
    engine = _engine(folder)
    layers = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    if weights == "fp8":
        assert all(m.dense_weight is not None for m in layers)
    else:
        assert engine.model.layers[0].self_attn.qkv_int4 is not None
    fast = _tokens(engine)

    if weights == "fp8":
        use_cpu_kernels(engine.model, enabled=False)  # dequantized per call
    else:
        monkeypatch.setattr(int4_cpu, "AVAILABLE", False)  # the torch reference
    assert _tokens(engine) == fast
