"""The engine's `quantize_head` option: the output head as its own int4 or bf16
copy, the embeddings untouched, logits close to the model's own head."""

import pytest
import torch

from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.engine.weights import Bf16Head, QuantLinear, quantize_head
from tests.gpuagent.conftest import DEMO_MODEL

PROMPT = "def add(a, b):\n    return"


def _logprobs(model, tokens):
    with torch.no_grad():
        return model.forward_dense(tokens).log_softmax(-1)[0]


@pytest.mark.parametrize(
    ("fmt", "kind", "max_kld"), [("int4", QuantLinear, 0.05), ("bf16", Bf16Head, 1e-3)]
)
def test_a_quantized_head_keeps_the_embeddings_and_logits_close(fmt, kind, max_kld):
    model = load_model(DEMO_MODEL)
    tokens = torch.tensor([load_tokenizer(DEMO_MODEL).encode_prompt(PROMPT * 8)])
    embedding = model.embed_tokens.weight.clone()
    reference = _logprobs(model, tokens)

    head = quantize_head(model, fmt)

    assert isinstance(model.lm_head, kind) and model.lm_head is head
    assert torch.equal(model.embed_tokens.weight, embedding)
    candidate = _logprobs(model, tokens)
    kld = (reference.exp() * (reference - candidate)).sum(-1).mean().item()
    assert 0 < kld <= max_kld, kld


def test_the_engine_decodes_with_a_quantized_head():
    tokenizer = load_tokenizer(DEMO_MODEL)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    engine = LLMEngine(
        load_model(DEMO_MODEL), tokenizer, num_blocks=16, quantize_head="int4"
    )

    assert isinstance(engine.model.lm_head, QuantLinear)
    # the other projections are still packed for oneDNN
    assert engine.model.layers[0].mlp.gate_up_packed is not None
    assert len(engine.generate([PROMPT], greedy)[0].token_ids) == 8


def test_it_refuses_an_unknown_head_format_and_a_second_replacement():
    model = load_model(DEMO_MODEL)
    with pytest.raises(ValueError, match="'int3' is not supported"):
        quantize_head(model, "int3")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_head(model, "int4", group_size=24)
    quantize_head(model, "bf16")
    with pytest.raises(ValueError, match="already replaced"):
        quantize_head(model, "int4")
