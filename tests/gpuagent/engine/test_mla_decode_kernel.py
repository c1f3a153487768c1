"""MLA decode through the Triton kernel (`kernels.mla_attention`, interpreted here)
against the torch path (`MLAAttention.decode_impl`), end to end in the engine on the
shipped MoE demo model, for every KV dtype of its latent cache: the same greedy
tokens and logits within a tight bound.

Both runs schedule the same steps, so the model's forward calls pair up one to one;
prefill attention runs the same torch code in both, except the last layer's, which
computes each sequence's last token only and so runs as decode (kernel included).
"""

from pathlib import Path

import pytest

import gpuagent.engine
import gpuagent.engine.mla as mla_module
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.mla import MLA_KV_DTYPES
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer

MOE_DIR = Path(gpuagent.engine.__file__).parent / "moe_demo_model"
# Different lengths (12 and 15 prompt tokens with the BOS): with 4-token blocks
# both cross block boundaries while decoding and end in partly filled blocks.
PROMPTS = ["def add(a, b):", "안녕하세요"]
MAX_TOKENS = 8
# Largest |logit| difference, kernel vs torch path, over every forward call of
# both runs: float32 throughout (the demo model is upcast), the two differ only in
# summation order (and where a quantized token's scales are multiplied), measured
# 1.4e-5 (bf16) and 4.8e-6 to 6.7e-6 (the other dtypes) on logits up to ~18;
# 1e-4 leaves 7x that, under 1e-5 of the largest logit.
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def moe_model():
    return load_model(MOE_DIR)


def run(model, kv_dtype: str, impl: str, monkeypatch) -> tuple[list, list, int]:
    """(greedy token ids per prompt, the logits of every forward call, kernel calls)
    of the engine with every layer's decode on `impl`."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["impl"])
        return kernel(*args, **kwargs)

    kernel = mla_module.mla_decode_attention
    monkeypatch.setattr(mla_module, "mla_decode_attention", counting)
    engine = LLMEngine(
        model,
        load_tokenizer(MOE_DIR),
        kv_cache_dtype=kv_dtype,
        num_blocks=32,
        block_size=4,
        prepack_weights=False,
    )
    for layer in model.layers:
        monkeypatch.setattr(layer.self_attn, "decode_impl", impl)
    logits = []
    hook = model.register_forward_hook(lambda m, i, out: logits.append(out.clone()))
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = engine.generate(PROMPTS, params)
    finally:
        hook.remove()
        monkeypatch.undo()
    return [o.token_ids for o in outs], logits, len(calls)


@pytest.mark.parametrize("kv_dtype", list(MLA_KV_DTYPES))
def test_it_generates_the_same_greedy_tokens_through_the_kernel(
    moe_model, kv_dtype, monkeypatch
):
    ref_tokens, ref_logits, ref_calls = run(
        moe_model, kv_dtype, "reference", monkeypatch
    )
    tokens, logits, calls = run(moe_model, kv_dtype, "triton", monkeypatch)

    layers = moe_model.config.num_hidden_layers
    assert ref_calls == 0
    # every decode step runs the kernel in every layer, a prefill in the last one
    assert calls >= layers * (MAX_TOKENS - 1)
    assert tokens == ref_tokens
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert len(logits) == len(ref_logits)
    diff = max(
        (a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True)
    )
    largest = max(a.abs().max().item() for a in ref_logits)
    print(
        f"{kv_dtype}: kernel vs torch logits max abs diff {diff:.2e} of {largest:.1f}"
    )
    assert diff <= LOGITS_ATOL, diff
