"""The engine option int8_activations: the int4 layers' CPU decode kernel with
activations rounded to int8 per block of 32 (kernels.int4_cpu), on the demo model
compressed w4a16-g128; refused where it does not apply."""

import pytest
import torch

from gpuagent.benches.llamacpp import common_prefix, int8_activation_quality
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.engine.weights import Int8ActivationsError, QuantLinear
from tests.gpuagent.conftest import DEMO_MODEL

PROMPT = "def add(a, b):\n    return"
NEW_TOKENS = 24


@pytest.fixture
def w4a16(demo_w4a16):
    return demo_w4a16


def _engine(folder, **options):
    return LLMEngine(
        load_model(folder), load_tokenizer(folder), num_blocks=16, **options
    )


def _prepared(model):
    return [m.int4_cpu for m in model.modules() if isinstance(m, QuantLinear)]


def test_greedy_tokens_and_logits_stay_close_to_float_activations(w4a16):
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    plain = _engine(w4a16)
    q8 = _engine(w4a16, int8_activations=True)

    assert all(not p.int8_activations for p in _prepared(plain.model))
    assert all(p.int8_activations for p in _prepared(q8.model))
    want = plain.generate([PROMPT], greedy)[0].token_ids
    got = q8.generate([PROMPT], greedy)[0].token_ids
    agree = common_prefix(got, want)
    print(f"greedy tokens equal before the first difference: {agree}/{NEW_TOKENS}")
    assert len(got) == NEW_TOKENS
    # int8 activations round every int4 matmul's input: the logits move, a little
    kld, top1, positions = int8_activation_quality(
        plain.model, q8.model, plain.tokenizer, max_len=64
    )
    print(f"mean KLD {kld:.2e}, same top-1 {top1:.1%} over {positions} positions")
    assert 0 < kld < 0.05 and top1 >= 0.8


def test_it_is_refused_where_it_does_not_apply(w4a16):
    # no int4 weights: the float demo model
    with pytest.raises(Int8ActivationsError, match="int4 weights"):
        _engine(DEMO_MODEL, int8_activations=True)
    # not float32
    with pytest.raises(Int8ActivationsError, match="float32 model on a CPU"):
        LLMEngine(
            load_model(w4a16, dtype=torch.bfloat16),
            load_tokenizer(w4a16),
            num_blocks=16,
            int8_activations=True,
        )
