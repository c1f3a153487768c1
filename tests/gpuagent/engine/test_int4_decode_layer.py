"""The one-call decode layer (kernels.int4_layer) in the engine, on the demo model
compressed w4a16-g128: it runs at every decode step it applies to and gives the
greedy tokens and logprobs of the per-op layers it replaces (one sequence and
several, float and int8 activations), and stays out where it does not apply."""

import pytest

from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from kernels import int4_cpu, int4_layer

PROMPTS = ["def add(a, b):\n    return", "The capital of France is", "1, 2, 3,"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)


def _engine(folder, **options):
    return LLMEngine(
        load_model(folder), load_tokenizer(folder), num_blocks=32, **options
    )


@pytest.fixture
def calls(monkeypatch):
    """How many layer steps ran through the one call."""
    count = [0]
    decode = int4_layer.decode

    def counted(*args, **kwargs):
        count[0] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(int4_layer, "decode", counted)
    return count


def _same(fast, per_op, tolerance):
    for a, b in zip(fast, per_op, strict=True):
        assert a.token_ids == b.token_ids
        gaps = [
            abs(x.logprob - y.logprob)
            for x, y in zip(a.logprobs, b.logprobs, strict=True)
        ]
        assert max(gaps) < tolerance, gaps


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "three"])
def test_decode_steps_run_one_call_a_layer_with_the_per_op_tokens(
    demo_w4a16, calls, prompts, int8_activations
):
    engine = _engine(demo_w4a16, int8_activations=int8_activations)
    layers = len(engine.model.layers)
    assert len(engine.model.int4_decode) == layers
    fast = engine.generate(prompts, GREEDY)
    # every token after the first comes from a decode step, each a call a layer
    assert calls[0] >= layers * (GREEDY.max_tokens - 1)
    assert calls[0] % layers == 0

    engine.model.int4_decode = None  # the torch layers over the same kernels
    before = calls[0]
    # The layers agree within float32 rounding; rounding x to int8 per block turns
    # a last-bit difference into a whole int8 step now and then (measured: 3e-3)
    _same(fast, engine.generate(prompts, GREEDY), 1e-2 if int8_activations else 1e-3)
    assert calls[0] == before


def test_it_stays_out_where_it_does_not_apply(demo_w4a16, calls, monkeypatch):
    # another cache layout: the torch layers write and read it
    _engine(demo_w4a16, kv_cache_dtype="fp8").generate(PROMPTS, GREEDY)
    assert calls[0] == 0
    # prefill only
    engine = _engine(demo_w4a16)
    engine.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0))
    assert calls[0] == 0
    # the benches' reference switch
    monkeypatch.setattr(int4_cpu, "AVAILABLE", False)
    engine.generate(PROMPTS, GREEDY)
    assert calls[0] == 0
    # float weights: no int4 layers to run
    from tests.gpuagent.conftest import DEMO_MODEL

    assert _engine(DEMO_MODEL).model.int4_decode is None
