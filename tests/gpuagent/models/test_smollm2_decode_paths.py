"""On the real model, SmolLM2-135M, every CPU decode speed path gives the greedy
tokens of its reference path: layers on one thread at decode vs torch's threads,
int4 q/k/v and gate/up fused through the prepared kernel vs the torch reference,
each int4 layer's decode step as one call (kernels.int4_layer) vs the torch layers,
fp8 dequantized once vs per call, the int8 head copy (its GGUF's Q8_0 head, so
exact) vs the checkpoint's head."""

from __future__ import annotations

import pytest
import torch

from gpuagent.compress.pipeline import compress
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.engine.weights import Int8Head, QuantLinear, use_cpu_kernels
from kernels import int4_cpu, int8_cpu

PROMPT = "def fibonacci(n):\n    "
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(folder, quantize_head=None) -> LLMEngine:
    return LLMEngine(
        load_model(folder),
        load_tokenizer(folder),
        num_blocks=16,
        max_num_seqs=1,
        quantize_head=quantize_head,
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
        assert len(engine.model.int4_decode) == len(engine.model.layers)
    fast = _tokens(engine)

    if weights == "fp8":
        use_cpu_kernels(engine.model, enabled=False)  # dequantized per call
    else:
        engine.model.int4_decode = None  # the torch layers over the kernel
        assert _tokens(engine) == fast
        monkeypatch.setattr(int4_cpu, "AVAILABLE", False)  # the torch reference
    assert _tokens(engine) == fast


def test_the_int8_head_is_the_checkpoints_head_and_gives_its_tokens(
    real_model_dir, tmp_path, two_threads
):
    # SmolLM2 was converted from a GGUF whose tied head is Q8_0: the group-32 int8
    # copy of the float32 checkpoint's head dequantizes to the very same matrix.
    # The w4a16 folder keeps its dense tensors in bf16, so there the copy rounds
    # the bf16 head again (within half a step of its group). Decode runs the copy
    # through the kernel (float32 sums in another order than the float GEMM's);
    # the greedy tokens are the same on both.
    folder = tmp_path / "w4a16-g128"
    compress(
        real_model_dir, {"weights": "w4a16-g128", "kv_cache_dtype": "bf16"}, folder
    )
    for model_dir in (real_model_dir, folder):
        engine = _engine(model_dir, quantize_head="int8")
        head = engine.model.lm_head
        assert isinstance(head, Int8Head) and head.group_size == 32
        checkpoint = engine.model.embed_tokens.weight.detach()  # tied
        copy = int8_cpu.dequantize_int8(head.codes, head.scale)
        if model_dir == real_model_dir:
            assert torch.equal(copy, checkpoint)
        else:
            step = head.scale.repeat_interleave(32, dim=1)
            assert ((copy - checkpoint).abs() <= 0.5001 * step).all()

        assert _tokens(engine) == _tokens(_engine(model_dir)), model_dir
