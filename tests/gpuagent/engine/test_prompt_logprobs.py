"""Prompt logprobs from the engine (what `echo` serves): every prompt token scored
once, across chunked prefill and preemption, equal to the dense model's."""

import pytest
import torch

from gpuagent.engine.sampling import SamplingParams


def dense_prompt_logprobs(model, ids: list[int]) -> list[float]:
    with torch.inference_mode():
        logprobs = torch.log_softmax(model.forward_dense(torch.tensor([ids])), -1)[0]
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_it_scores_every_prompt_token_across_prefill_chunks(make_engine):
    engine = make_engine(kv_cache_dtype="fp32", max_num_batched_tokens=5)
    prompt = "chunked prefill, five tokens a step"
    ids = engine.encode_prompt(prompt)

    (out,) = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3))

    assert out.token_ids == [] and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    assert [lp.token_id for lp in out.prompt_logprobs[1:]] == ids[1:]
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]
    assert got == pytest.approx(dense_prompt_logprobs(engine.model, ids), abs=1e-4)
    for lp in out.prompt_logprobs[1:]:
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][1] >= lp.logprob - 1e-6
    assert engine.kv.blocks.num_used_blocks == 0


def test_a_preempted_request_keeps_one_score_per_prompt_token(make_engine):
    # 6 blocks of 4 tokens: two 10-token prompts growing to 22 tokens can't both
    # stay, so the newer one is preempted and its prompt recomputed.
    engine = make_engine(kv_cache_dtype="fp32", num_blocks=7, block_size=4)
    prompts = ["0123456789", "abcdefghij"]
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0
    )

    outs = engine.generate(prompts, params)

    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = engine.encode_prompt(prompt)
        assert len(out.prompt_logprobs) == len(ids)
        got = [lp.logprob for lp in out.prompt_logprobs[1:]]
        assert got == pytest.approx(dense_prompt_logprobs(engine.model, ids), abs=1e-4)
