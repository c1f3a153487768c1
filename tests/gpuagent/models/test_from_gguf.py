"""The GGUF converter on small GGUF files written here with the `gguf` package's
writer, the way llama.cpp's converter writes a HF Llama (q/k rows permuted per head,
shapes fastest dimension first, tied output head left out): the converted folder must
give back the original tensors, load in transformers and in the engine with the same
logits, and agree with transformers' own GGUF loader. Unsupported files are named
errors, and a failed or refused conversion leaves no folder behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuagent.models import from_gguf
from gpuagent.models.from_gguf import ConversionError, convert, unpermute_rope_rows

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
}
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]


def byte_chars() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def tiny_vocab() -> list[str]:
    """Control tokens first (as SmolLM2's), then the 256 byte chars, then merges."""
    return CONTROL + byte_chars() + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py: halves -> adjacent pairs, per head
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_tiny_model(tied: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tiny_vocab()),
        tie_word_embeddings=tied,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        **TINY,
    )
    return LlamaForCausalLM(config).eval()


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(
    path: Path,
    model,
    *,
    add_bos: bool = False,
    pre: str = "smollm",
    quantize_embedding: bool = False,
    extra_tensor: str | None = None,
    extra_key: tuple[str, int] | None = None,
    arch: str = "llama",
) -> Path:
    """`model` (a transformers Llama) as llama.cpp would write it."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(TINY["rope_theta"])  # transformers 5 nests it
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if extra_key is not None:
        writer.add_uint32(*extra_key)
    vocab = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab)
    writer.add_token_types([3 if t in CONTROL else 1 for t in vocab])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    embed = state["model.embed_tokens.weight"]
    if quantize_embedding:
        q8 = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(
            "token_embd.weight", gguf.quants.quantize(embed, q8), raw_dtype=q8
        )
    else:
        writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    for layer in range(cfg.num_hidden_layers):
        for hf, name in GGUF_NAMES.items():
            w = state[f"model.layers.{layer}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif hf == "self_attn.k_proj":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{layer}.{name}.weight", np.ascontiguousarray(w))
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def converted(request, tmp_path_factory):
    """(original transformers model, GGUF path, converted folder)."""
    tmp = tmp_path_factory.mktemp("gguf")
    model = hf_tiny_model(tied=request.param)
    path = write_gguf(tmp / "tiny.gguf", model)
    return model, path, convert(path, tmp / "hf")


def test_it_gives_back_the_original_tensors(converted):
    from safetensors.torch import load_file

    model, _, out = converted
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    got = load_file(out / "model.safetensors")
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_it_writes_a_config_transformers_and_the_engine_run_alike(converted):
    from transformers import AutoModelForCausalLM

    from gpuagent.engine.loader import load_model

    model, _, out = converted
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is model.config.tie_word_embeddings
    assert config["rms_norm_eps"] == 1e-5  # float32 1e-5, written as the HF config
    tokens = torch.tensor([[1, 40, 77, 9, 260, 261, 100, 3]])
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(out)
    with torch.no_grad():
        want = model(tokens).logits
        assert torch.equal(loaded(tokens).logits, want)
        assert (ours.forward_dense(tokens) - want).abs().max() <= 1e-5


def test_it_agrees_with_transformers_own_gguf_loader(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path, out = converted
    oracle = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want, got = oracle.state_dict(), ours.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    text = "the theatre in a hall<|im_end|> then"
    oracle_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours_tok = AutoTokenizer.from_pretrained(out)
    assert ours_tok(text).input_ids == oracle_tok(text).input_ids


def test_it_dequantizes_quantized_tensors_like_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = hf_tiny_model(tied=True)
    path = write_gguf(tmp_path / "q8.gguf", model, quantize_embedding=True)
    out = convert(path, tmp_path / "hf")
    oracle = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    name = "model.embed_tokens.weight"
    assert torch.equal(ours.state_dict()[name], oracle.state_dict()[name])
    # Q8_0 is lossy: close to the original, not equal
    error = (ours.state_dict()[name] - model.state_dict()[name]).abs().max()
    assert 0 < error < 0.01


def test_it_undoes_the_permutation_per_head():
    # head h, GGUF row 2i + j  ->  HF row j * D/2 + i
    heads, dim = 3, 8
    gguf_rows = np.arange(heads * dim, dtype=np.float32)[:, None]
    hf = unpermute_rope_rows(gguf_rows, heads)[:, 0]
    for h in range(heads):
        for i in range(dim // 2):
            for j in range(2):
                assert hf[h * dim + j * dim // 2 + i] == h * dim + 2 * i + j


def test_it_follows_the_gguf_bos_flag(tmp_path):
    from transformers import AutoTokenizer

    from gpuagent.engine.tokenizer import load_tokenizer

    model = hf_tiny_model(tied=True)
    for add_bos in (True, False):
        path = write_gguf(tmp_path / f"bos{add_bos}.gguf", model, add_bos=add_bos)
        out = convert(path, tmp_path / f"hf{add_bos}")
        config = json.loads((out / "tokenizer_config.json").read_text())
        assert config["add_bos_token"] is add_bos
        assert config["bos_token"] == "<|im_start|>"
        assert config["eos_token"] == "<|im_end|>"
        assert "chat_template" in config
        ids = AutoTokenizer.from_pretrained(out)("the hat").input_ids
        tokenizer = load_tokenizer(out)
        plain = tokenizer.inner.encode("the hat", add_special_tokens=False).ids
        assert ids == ([1] if add_bos else []) + plain
        with_specials = tokenizer.inner.encode("the hat", add_special_tokens=True).ids
        assert with_specials == ids


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(arch="gpt2"), "general.architecture 'gpt2'"),
        (dict(pre="qwen2"), "tokenizer.ggml.pre 'qwen2'"),
        (dict(extra_tensor="rope_freqs.weight"), "rope_freqs.weight"),
        (dict(extra_key=("llama.expert_count", 8)), "llama.expert_count"),
    ],
)
def test_it_names_what_it_does_not_convert(tmp_path, change, message):
    path = write_gguf(tmp_path / "bad.gguf", hf_tiny_model(tied=True), **change)
    with pytest.raises(ConversionError, match=message.replace(".", r"\.")):
        convert(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_it_leaves_no_folder_when_writing_fails(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", hf_tiny_model(tied=True))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(from_gguf, "_write_json", disk_full)
    with pytest.raises(OSError, match="No space"):
        convert(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_it_refuses_an_existing_folder_unless_forced(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_tiny_model(tied=True))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        convert(path, out)
    assert (out / "keep.txt").read_text() == "mine"
    convert(path, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(from_gguf.OUTPUT_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]


def test_it_writes_bfloat16_when_asked(tmp_path):
    from safetensors.torch import load_file

    model = hf_tiny_model(tied=True)
    path = write_gguf(tmp_path / "m.gguf", model)
    out = convert(path, tmp_path / "out", dtype="bfloat16")
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    name = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(tensors[name], model.state_dict()[name].bfloat16())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_its_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", hf_tiny_model(tied=True), pre="qwen2")
    assert from_gguf.main([str(path), str(tmp_path / "out")]) == 1
    assert "error: tokenizer.ggml.pre 'qwen2'" in capsys.readouterr().err
    assert from_gguf.main([str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 1
