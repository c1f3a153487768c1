"""Parity of gpuagent.engine.model with transformers' LlamaForCausalLM, dense and paged.

Tiny random HF folders are written with transformers' own save_pretrained and read
back through our loader, so names, layouts and RoPE conventions are checked end to end.
With the fp32 KV cache (a plain copy) the paged path, the one the engine serves with,
is held to the same 1e-4 as the dense path; with fp16/bf16 KV only up to the rounding
of K/V to 16 bits: see PAGED_ATOL.
"""

import copy

import pytest
import torch
import transformers

from gpuagent.engine.loader import load_model
from gpuagent.engine.model import (
    AttentionMetadata,
    LlamaConfig,
    allocate_kv_caches,
    rope_inv_freq,
)
from tests.gpuagent.engine.paged_driver import run_paged

DENSE_ATOL = 1e-4
# The paged path stores K/V rounded to 16 bits (fp16: 11 significant bits, bf16: 8).
# On these random models (|logits| up to ~4.5) that moves logits by up to ~5e-3 (fp16)
# and ~3.5e-2 (bf16) vs fp32 transformers; PAGED_ATOL leaves headroom for other BLAS
# builds while a real bug (wrong position, block or head) shows up as O(1). Against
# the dense path with K/V rounded the same way the paged path agrees to MATCHED_ATOL:
# not 0, because a 1e-7 difference in a K element can flip its rounding by one ulp.
PAGED_ATOL = {"fp16": 1e-2, "bf16": 6e-2, "fp32": DENSE_ATOL}
MATCHED_ATOL = 2e-4
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_folder(path, seed=0, **overrides):
    """Save a tiny random LlamaForCausalLM with transformers; return it (fp32, eval)."""
    kwargs = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.15,  # big enough that logits differ visibly per token
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()
    with torch.no_grad():  # non-trivial norm weights, so a skipped norm would show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # [T, V]


def _tokens(n, vocab=97, seed=1):
    return torch.randint(
        0, vocab, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_it_matches_transformers_dense_fp32_with_gqa(tmp_path):
    hf = _hf_folder(tmp_path)
    model = load_model(tmp_path)
    tokens = _tokens(21)

    ours = model.forward_dense(torch.tensor([tokens]))[0]

    diff = (ours - _hf_logits(hf, tokens)).abs().max().item()
    assert diff <= DENSE_ATOL, diff
    assert model.config.num_key_value_heads < model.config.num_attention_heads


@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
def test_it_matches_transformers_paged_prefill_and_decode(tmp_path, kv_dtype):
    hf = _hf_folder(tmp_path)
    model = load_model(tmp_path)
    seqs = [_tokens(19, seed=2), _tokens(13, seed=3)]

    paged = run_paged(model, seqs, prefill_lens=[11, 6], kv_dtype=kv_dtype)

    for s, logits in zip(seqs, paged, strict=True):
        diff = (logits - _hf_logits(hf, s)).abs().max().item()
        assert diff <= PAGED_ATOL[kv_dtype], (kv_dtype, diff)


@pytest.mark.parametrize(
    ("overrides", "chunk"),
    [
        ({}, None),  # GQA (4 heads on 2 kv heads), untied; whole-prompt prefill
        ({}, 4),  # chunked prefill, later chunks batched with other seqs' decodes
        ({"tie_word_embeddings": True, "num_key_value_heads": 1}, 3),
        ({"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}, 8),
    ],
    ids=["gqa-untied", "gqa-chunked", "tied-mqa-chunked", "llama3-rope-chunked"],
)
@pytest.mark.parametrize("prepack", [False, True], ids=["dense-weights", "prepacked"])
def test_it_matches_transformers_on_the_paged_path_with_fp32_kv(
    tmp_path, overrides, chunk, prepack
):
    # a deep copy: transformers writes rope_theta into the dict it is given
    hf = _hf_folder(tmp_path, **copy.deepcopy(overrides))
    model = load_model(tmp_path)
    # prepacked: the engine's CPU configuration (oneDNN GEMMs, q/k/v and gate/up
    # fused), held to the same bar
    if prepack:
        assert model.prepack_cpu_weights()
    # 40 tokens: past llama3's original_max_position_embeddings=16; the first two
    # seqs decode 10 and 11 steps after their prefill, the third only prefills.
    seqs = [_tokens(40, seed=2), _tokens(23, seed=3), _tokens(9, seed=4)]

    paged = run_paged(model, seqs, [30, 12, 9], kv_dtype="fp32", chunk=chunk)

    for s, logits in zip(seqs, paged, strict=True):
        assert logits.shape == (len(s), model.config.vocab_size)
        diff = (logits - _hf_logits(hf, s)).abs().max().item()
        assert diff <= PAGED_ATOL["fp32"], diff
    tied = model.lm_head.weight is model.embed_tokens.weight
    assert tied == bool(overrides.get("tie_word_embeddings"))
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert (model.config.rope_scaling is not None) == ("rope_scaling" in overrides)


def test_it_matches_transformers_through_the_triton_kernels_with_fp32_kv(
    tmp_path, monkeypatch
):
    # The kernels the engine runs on CUDA, here under the interpreter: same bar.
    import gpuagent.engine.model as model_module

    calls = []

    def on_triton(name, kernel):
        def run(*args):
            calls.append(name)
            return kernel(*args, impl="triton")

        return run

    for name in ("write_kv", "paged_decode_attention", "paged_prefill_attention"):
        monkeypatch.setattr(
            model_module, name, on_triton(name, getattr(model_module, name))
        )
    hf = _hf_folder(tmp_path, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING))
    model = load_model(tmp_path)
    seqs = [_tokens(40, seed=2), _tokens(23, seed=3)]

    paged = run_paged(model, seqs, [30, 12], kv_dtype="fp32", chunk=8)

    for s, logits in zip(seqs, paged, strict=True):
        diff = (logits - _hf_logits(hf, s)).abs().max().item()
        assert diff <= PAGED_ATOL["fp32"], diff
    assert {"write_kv", "paged_decode_attention", "paged_prefill_attention"} == set(
        calls
    )


@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
def test_it_matches_the_dense_path_given_the_same_kv_rounding(
    tmp_path, monkeypatch, kv_dtype
):
    _hf_folder(tmp_path)
    model = load_model(tmp_path)
    seqs = [_tokens(19, seed=2), _tokens(13, seed=3)]
    paged = run_paged(model, seqs, prefill_lens=[11, 6], kv_dtype=kv_dtype)
    storage = {"fp16": torch.float16, "bf16": torch.bfloat16}[kv_dtype]
    for layer in model.layers:
        _round_dense_kv(monkeypatch, layer.self_attn, storage)

    for s, logits in zip(seqs, paged, strict=True):
        dense = model.forward_dense(torch.tensor([s]))[0]
        assert (logits - dense).abs().max().item() <= MATCHED_ATOL


def _round_dense_kv(monkeypatch, attn_module, storage):
    # The dense path, with K and V rounded to the cache's storage dtype
    qkv = attn_module._qkv

    def rounded(x, cos, sin):
        q, k, v = qkv(x, cos, sin)
        return q, k.to(storage).float(), v.to(storage).float()

    monkeypatch.setattr(attn_module, "_qkv", rounded)


def test_it_matches_transformers_with_llama3_rope_scaling(tmp_path):
    # a copy: transformers writes rope_theta into the dict it is given
    hf = _hf_folder(tmp_path, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING))
    model = load_model(tmp_path)
    tokens = _tokens(40)  # past original_max_position_embeddings=16

    dense = model.forward_dense(torch.tensor([tokens]))[0]
    (paged,) = run_paged(model, [tokens], prefill_lens=[30], kv_dtype="fp16")

    expected = _hf_logits(hf, tokens)
    assert (dense - expected).abs().max().item() <= DENSE_ATOL
    assert (paged - expected).abs().max().item() <= PAGED_ATOL["fp16"]
    assert model.config.rope_scaling["rope_type"] == "llama3"


def test_it_scales_only_low_frequencies_for_llama3_rope():
    llama31 = {**LLAMA3_SCALING, "original_max_position_embeddings": 8192}
    plain = LlamaConfig(97, 64, 160, 2, 4, 2, 16, rope_theta=500000.0)
    scaled = LlamaConfig(
        97, 64, 160, 2, 4, 2, 16, rope_theta=500000.0, rope_scaling=llama31
    )

    ratio = rope_inv_freq(plain) / rope_inv_freq(scaled)  # [8]

    assert ratio[0].item() == pytest.approx(1.0)  # wavelength 6 < 8192/4: kept
    assert ratio[-1].item() == pytest.approx(8.0)  # wavelength > 8192: / factor
    assert ((ratio >= 1.0 - 1e-6) & (ratio <= 8.0 + 1e-6)).all()


def test_it_matches_transformers_with_tied_embeddings(tmp_path):
    hf = _hf_folder(tmp_path, tie_word_embeddings=True, num_key_value_heads=1)
    model = load_model(tmp_path)
    tokens = _tokens(17)

    ours = model.forward_dense(torch.tensor([tokens]))[0]

    assert model.lm_head.weight is model.embed_tokens.weight
    assert (ours - _hf_logits(hf, tokens)).abs().max().item() <= DENSE_ATOL


def test_it_returns_last_token_logits_per_sequence_by_default(tmp_path):
    _hf_folder(tmp_path)
    model = load_model(tmp_path)
    seqs = [_tokens(7, seed=4), _tokens(5, seed=5)]
    caches = allocate_kv_caches(model.config, "fp16", num_blocks=4, block_size=8)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(list(range(7)) + list(range(16, 21))),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 7, 12], dtype=torch.int32),
        context_lens=torch.tensor([7, 5], dtype=torch.int32),
        decode_only=False,
    )
    positions = torch.tensor(list(range(7)) + list(range(5)))

    with torch.no_grad():
        last = model(torch.tensor(seqs[0] + seqs[1]), positions, caches, attn)

    assert last.shape == (2, model.config.vocab_size) and last.dtype == torch.float32
    for b, s in enumerate(seqs):
        dense = model.forward_dense(torch.tensor([s]))[0, -1]
        assert (last[b] - dense).abs().max().item() <= PAGED_ATOL["fp16"]


def test_it_allocates_one_cache_per_layer_shaped_for_the_model(tmp_path):
    _hf_folder(tmp_path, num_hidden_layers=3, num_key_value_heads=1)
    config = load_model(tmp_path).config

    caches = allocate_kv_caches(config, "int8", num_blocks=5, block_size=16)

    assert len(caches) == 3
    assert {(c.num_kv_heads, c.head_dim, c.num_blocks, c.dtype) for c in caches} == {
        (1, 16, 5, "int8")
    }


def test_it_reads_rope_theta_from_either_config_layout():
    legacy = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 123.0,
        "rope_scaling": dict(LLAMA3_SCALING),
    }
    v5 = {**legacy, "rope_parameters": {"rope_theta": 123.0, **LLAMA3_SCALING}}
    del v5["rope_theta"], v5["rope_scaling"]

    a, b = LlamaConfig.from_hf_config(legacy), LlamaConfig.from_hf_config(v5)

    assert a.rope_theta == b.rope_theta == 123.0
    assert a.rope_scaling == b.rope_scaling == LLAMA3_SCALING
    assert a.num_key_value_heads == 2 and a.head_dim == 4


@pytest.mark.parametrize(
    "bad",
    [
        {"attention_bias": True},
        {"hidden_act": "gelu"},
        {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    ],
)
def test_it_refuses_llama_variants_it_does_not_implement(bad):
    cfg = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **bad,
    }

    with pytest.raises(ValueError):
        LlamaConfig.from_hf_config(cfg)


def test_it_continues_a_prompt_prefilled_in_chunks(tmp_path):
    hf = _hf_folder(tmp_path)
    model = load_model(tmp_path)
    tokens = _tokens(15, seed=6)
    caches = allocate_kv_caches(model.config, "fp16", num_blocks=4, block_size=4)
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    slots = [table[0, p // 4].item() * 4 + p % 4 for p in range(15)]

    chunks = []
    for lo, hi in [(0, 6), (6, 15)]:  # the second chunk sees the first through cache
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots[lo:hi]),
            block_tables=table,
            query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
            context_lens=torch.tensor([hi], dtype=torch.int32),
            decode_only=False,
        )
        ids, positions = torch.tensor(tokens[lo:hi]), torch.arange(lo, hi)
        with torch.no_grad():
            chunks.append(model(ids, positions, caches, attn, all_logits=True))

    diff = (torch.cat(chunks) - _hf_logits(hf, tokens)).abs().max().item()
    assert diff <= PAGED_ATOL["fp16"]


def test_it_runs_a_bfloat16_model_on_the_paged_path_close_to_fp32(tmp_path):
    _hf_folder(tmp_path)
    fp32, bf16 = load_model(tmp_path), load_model(tmp_path, dtype=torch.bfloat16)
    seqs = [_tokens(12, seed=7)]

    (ours,) = run_paged(bf16, seqs, prefill_lens=[8], kv_dtype="bf16")

    reference = fp32.forward_dense(torch.tensor(seqs))[0]
    assert ours.dtype == torch.float32
    assert bf16.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    # bf16 weights and activations: ~3 significant digits on |logits| ~4
    assert (ours - reference).abs().max().item() <= 0.25
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9


def test_it_prepacks_fused_cpu_gemms_that_agree_with_the_dense_weights(tmp_path):
    _hf_folder(tmp_path)
    dense, packed = load_model(tmp_path), load_model(tmp_path)
    tokens = torch.tensor([_tokens(17)])

    assert packed.prepack_cpu_weights()

    attn, mlp = packed.layers[0].self_attn, packed.layers[0].mlp
    assert attn.qkv_packed is not None and mlp.gate_up_packed is not None
    assert packed.lm_head.packed_weight is not None
    ours, theirs = packed.forward_dense(tokens), dense.forward_dense(tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    # the dense weights stay: the state dict is unchanged
    assert packed.state_dict().keys() == dense.state_dict().keys()


def test_it_prepacks_bfloat16_weights_where_onednn_has_bf16_kernels(tmp_path):
    _hf_folder(tmp_path)
    dense = load_model(tmp_path, dtype=torch.bfloat16)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    tokens = torch.tensor([_tokens(17)])
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

    assert model.prepack_cpu_weights() is supported

    packed = model.layers[0].self_attn.qkv_packed is not None
    assert packed is supported and (model.lm_head.packed_weight is not None) is packed
    with torch.inference_mode():
        ours, theirs = model.forward_dense(tokens), dense.forward_dense(tokens)
    # the same bf16 GEMMs, laid out once
    torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.02)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.95
