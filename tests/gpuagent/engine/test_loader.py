"""gpuagent.engine.loader: HF folders in every supported layout, and every refusal."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gpuagent.engine.loader import ModelLoadError, load_model

TINY = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.15,
)


def _hf_folder(path, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    hf = transformers.LlamaForCausalLM(config).eval().to(dtype)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


TOKENS = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]


def test_it_loads_sharded_checkpoints_through_the_index(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())

    model = load_model(tmp_path)

    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    diff = (model.forward_dense(torch.tensor([TOKENS]))[0] - _logits(hf, TOKENS)).abs()
    assert diff.max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_it_loads_half_precision_checkpoints_into_any_dtype(tmp_path, dtype):
    _hf_folder(tmp_path, dtype=dtype)
    stored = load_file(tmp_path / "model.safetensors")

    as_fp32 = load_model(tmp_path, dtype=torch.float32)
    as_stored = load_model(tmp_path, dtype=dtype)

    assert {t.dtype for t in stored.values()} == {dtype}
    assert as_fp32.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    assert as_stored.norm.weight.dtype == dtype
    # fp32 compute on the stored half weights matches HF reading them as fp32
    # (a fresh load: hf.float() would keep RoPE frequencies rounded to half)
    reference = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32
    ).eval()
    expected = _logits(reference, TOKENS)
    got = as_fp32.forward_dense(torch.tensor([TOKENS]))[0]
    assert (got - expected).abs().max().item() <= 1e-4


def test_it_loads_only_from_the_given_file_bytes(tmp_path):
    hf = _hf_folder(tmp_path / "real")
    files = {p.name: p.read_bytes() for p in (tmp_path / "real").iterdir()}
    elsewhere = tmp_path / "empty"
    elsewhere.mkdir()

    model = load_model(elsewhere, files=files)

    got = model.forward_dense(torch.tensor([TOKENS]))[0]
    assert (got - _logits(hf, TOKENS)).abs().max().item() <= 1e-4


def test_it_does_not_read_disk_for_a_file_missing_from_the_given_bytes(tmp_path):
    _hf_folder(tmp_path)
    files = {"config.json": (tmp_path / "config.json").read_bytes()}

    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(tmp_path, files=files)


def test_it_names_missing_and_unexpected_tensors(tmp_path):
    _hf_folder(tmp_path)

    def edit(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)

    _edit_weights(tmp_path, edit)

    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path)
    assert "missing tensors ['model.layers.1.mlp.up_proj.weight']" in str(err.value)
    assert "unexpected tensors ['model.layers.1.mlp.extra.weight']" in str(err.value)


def test_it_names_tensors_whose_shape_does_not_match_the_config(tmp_path):
    _hf_folder(tmp_path)
    _edit_config(tmp_path, intermediate_size=48)

    with pytest.raises(ModelLoadError, match=r"shape mismatch.*gate_proj.*\(64, 32\)"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"auto_map": {"AutoModelForCausalLM": "evil.Model"}},
            r"auto_map .*gpuagent\.models\.import_published SRC DST",
        ),
        ({"model_type": "mistral"}, "model_type"),
        ({"architectures": ["MyLlamaForCausalLM"]}, "architectures"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_size": None}, "config.json"),
        ({"num_attention_heads": 0, "head_dim": None}, "config.json"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            r"lacks \['low_freq_factor', 'high_freq_factor', 'original_max",
        ),
    ],
    ids=[
        "auto_map",
        "model_type",
        "architectures",
        "bias",
        "type",
        "zero-heads",
        "llama3-keys",
    ],
)
def test_it_refuses_configs_it_must_not_or_cannot_run(tmp_path, change, message):
    _hf_folder(tmp_path)
    _edit_config(tmp_path, **change)

    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path)


def test_it_refuses_tensors_that_are_not_floating_point(tmp_path):
    _hf_folder(tmp_path)

    def edit(tensors):
        tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int8)

    _edit_weights(tmp_path, edit)

    with pytest.raises(ModelLoadError, match="unsupported tensor dtypes"):
        load_model(tmp_path)


def test_it_refuses_a_tied_config_whose_lm_head_differs(tmp_path):
    _hf_folder(tmp_path, tie_word_embeddings=True)

    def edit(tensors):
        tensors["lm_head.weight"] = torch.randn_like(
            tensors["model.embed_tokens.weight"]
        )

    _edit_weights(tmp_path, edit)

    with pytest.raises(ModelLoadError, match="lm_head.weight differs"):
        load_model(tmp_path)


def test_it_refuses_an_index_that_points_outside_the_folder(tmp_path):
    _hf_folder(tmp_path)
    index = {"weight_map": {"model.norm.weight": "../outside.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    with pytest.raises(ModelLoadError, match="outside the folder"):
        load_model(tmp_path)


def test_it_refuses_a_file_that_is_not_safetensors(tmp_path):
    _hf_folder(tmp_path)
    # what a pickle-based checkpoint renamed to .safetensors would look like
    (tmp_path / "model.safetensors").write_bytes(b"\x80\x04\x95" + b"\x00" * 64)

    with pytest.raises(ModelLoadError, match="not a valid safetensors file"):
        load_model(tmp_path)


def test_it_refuses_a_config_that_starts_with_a_byte_order_mark(tmp_path):
    # transformers and the integrity gate refuse it; json.loads of bytes would not
    _hf_folder(tmp_path)
    config = tmp_path / "config.json"
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())

    with pytest.raises(ModelLoadError, match="config.json is not JSON.*BOM"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("config.json", "[1, 2]", "config.json is not a JSON object"),
        ("config.json", "{oops", "config.json is not JSON"),
        ("model.safetensors.index.json", "{}", "has no weight_map"),
        ("model.safetensors.index.json", '{"weight_map": [1]}', "has no weight_map"),
        (
            "model.safetensors.index.json",
            '{"weight_map": {"model.norm.weight": "weights.dat"}}',
            "shard that is not .safetensors: 'weights.dat'",
        ),
    ],
    ids=["config-array", "config-text", "index-empty", "index-list", "index-dat"],
)
def test_it_names_what_is_wrong_with_a_config_or_index_file(
    tmp_path, name, content, message
):
    _hf_folder(tmp_path)
    (tmp_path / name).write_text(content)

    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path)
