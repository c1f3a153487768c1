"""Decode steps on a CPU run their layers at `Transformer.small_step_threads`
threads and give the same greedy tokens as with torch's setting throughout."""

import torch

from gpuagent.engine import model as model_module
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from tests.gpuagent.conftest import DEMO_MODEL


def test_small_steps_run_the_layers_narrow_with_the_same_tokens(monkeypatch):
    engine = LLMEngine(
        load_model(DEMO_MODEL), load_tokenizer(DEMO_MODEL), num_blocks=32
    )
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    seen = []
    block_forward = model_module.TransformerBlock.forward

    def spy(self, x, *args, **kwargs):
        seen.append((x.shape[0], torch.get_num_threads()))
        return block_forward(self, x, *args, **kwargs)

    monkeypatch.setattr(model_module.TransformerBlock, "forward", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.model.small_step_threads = None
        wide = engine.generate(["def add(a, b):"], greedy)[0].token_ids
        assert {threads for _, threads in seen} == {2}
        seen.clear()
        engine.model.small_step_threads = 1
        narrow = engine.generate(["def add(a, b):"], greedy)[0].token_ids
        assert torch.get_num_threads() == 2  # restored after each step
    finally:
        torch.set_num_threads(before)

    assert narrow == wide
    # the prompt's chunk (more rows) keeps both threads, each decode step runs on one
    assert {t for rows, t in seen if rows > model_module.SMALL_STEP_ROWS} == {2}
    assert {t for rows, t in seen if rows == 1} == {1}


def test_the_head_runs_narrow_too_when_asked_with_the_same_tokens(monkeypatch):
    engine = LLMEngine(
        load_model(DEMO_MODEL), load_tokenizer(DEMO_MODEL), num_blocks=32
    )
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    seen = []
    head = engine.model.lm_head
    head_forward = head.forward

    def spy(x):
        seen.append((x.shape[0], torch.get_num_threads()))
        return head_forward(x)

    monkeypatch.setattr(head, "forward", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        wide = engine.generate(["def add(a, b):"], greedy)[0].token_ids
        assert {t for _, t in seen} == {2}  # off by default: the head keeps 2
        seen.clear()
        engine.model.small_step_head = True
        narrow = engine.generate(["def add(a, b):"], greedy)[0].token_ids
        assert torch.get_num_threads() == 2  # restored after each step
    finally:
        torch.set_num_threads(before)

    assert narrow == wide
    # decode steps' heads ran on one thread; the prompt's step (more rows) on two
    assert {t for _, t in seen[1:]} == {1} and seen[0][1] == 2
