"""The engine's `quantize_head` option: the output head as its own int8, int4 or
bf16 copy, the embeddings untouched, logits close to the model's own head."""

import pytest
import torch

from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.engine.weights import Bf16Head, Int8Head, QuantLinear, quantize_head
from kernels import int8_cpu
from tests.gpuagent.conftest import DEMO_MODEL

PROMPT = "def add(a, b):\n    return"


def _logprobs(model, tokens):
    with torch.no_grad():
        return model.forward_dense(tokens).log_softmax(-1)[0]


@pytest.mark.parametrize(
    ("fmt", "kind", "max_kld"),
    [("int8", Int8Head, 1e-4), ("int4", QuantLinear, 0.05), ("bf16", Bf16Head, 1e-3)],
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


@pytest.mark.parametrize(("fmt", "kind"), [("int8", Int8Head), ("int4", QuantLinear)])
def test_the_engine_decodes_with_a_quantized_head(fmt, kind):
    tokenizer = load_tokenizer(DEMO_MODEL)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    engine = LLMEngine(
        load_model(DEMO_MODEL), tokenizer, num_blocks=16, quantize_head=fmt
    )

    assert isinstance(engine.model.lm_head, kind)
    # the other projections are still packed for oneDNN
    assert engine.model.layers[0].mlp.gate_up_packed is not None
    assert len(engine.generate([PROMPT], greedy)[0].token_ids) == 8


def test_it_refuses_an_unknown_head_format_and_a_second_replacement():
    model = load_model(DEMO_MODEL)
    with pytest.raises(ValueError, match="'int3' is not supported"):
        quantize_head(model, "int3")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_head(model, "int4", group_size=24)
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_head(model, "int8", group_size=12)
    quantize_head(model, "bf16")
    with pytest.raises(ValueError, match="already replaced"):
        quantize_head(model, "int4")


def test_the_int8_head_leaves_the_demo_models_greedy_tokens_but_at_near_ties():
    # The demo model's head is not of Q8_0's form (SmolLM2's is: there the copy is
    # exact, tests/gpuagent/models), so int8 rounding moves each logit by up to
    # ~0.04 (asserted <= 0.05) and can flip a near-tie. Measured, 16 tokens each:
    # two prompts give the same tokens; "The capital of France is" parts at its
    # 4th, where the float head's top two logits are 0.005 apart. So: where the
    # tokens part, the float head's logit gap between the two choices is within
    # twice the largest logit change of the int8 copy there (teacher-forced).
    tokenizer = load_tokenizer(DEMO_MODEL)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, "The capital of France is", "Once upon a time"]
    tokens = {}
    for fmt in ("int8", None):
        engine = LLMEngine(
            load_model(DEMO_MODEL), tokenizer, num_blocks=64, quantize_head=fmt
        )
        tokens[fmt] = [out.token_ids for out in engine.generate(prompts, greedy)]
    float_model, int8_model = load_model(DEMO_MODEL), load_model(DEMO_MODEL)
    quantize_head(int8_model, "int8")

    same = 0
    for prompt, ours, theirs in zip(prompts, tokens["int8"], tokens[None], strict=True):
        if ours == theirs:
            same += 1
            continue
        at = next(
            i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b
        )
        ids = torch.tensor([tokenizer.encode_prompt(prompt) + theirs[:at]])
        with torch.no_grad():
            want = float_model.forward_dense(ids)[0, -1]
            got = int8_model.forward_dense(ids)[0, -1]
        gap = (want[theirs[at]] - want[ours[at]]).item()
        moved = (want - got).abs().max().item()
        assert 0 <= gap <= 2 * moved <= 0.1, (prompt, at, gap, moved)
    assert same >= 2, tokens


def test_the_int8_head_runs_the_kernel_at_decode_and_blocks_at_prefill(monkeypatch):
    model = load_model(DEMO_MODEL)
    weight = model.lm_head.weight.detach().clone()
    head = quantize_head(model, "int8")
    calls = []
    real = int8_cpu.int8_matmul
    monkeypatch.setattr(
        int8_cpu, "int8_matmul", lambda x, *a: calls.append(x.shape[0]) or real(x, *a)
    )
    copy = int8_cpu.dequantize_int8(head.codes, head.scale)
    for rows in (1, int8_cpu.MAX_ROWS, int8_cpu.MAX_ROWS + 1):
        x = torch.randn(
            rows, weight.shape[1], generator=torch.Generator().manual_seed(0)
        )
        y = head(x)
        # the copy's own matrix within float32 sums' rounding; the float head's
        # within int8 rounding
        assert torch.allclose(y, x @ copy.t(), rtol=1e-4, atol=1e-4)
        assert (y - x @ weight.t()).abs().max() <= 0.02 * (x @ weight.t()).abs().max()

    assert calls == [1, int8_cpu.MAX_ROWS]
