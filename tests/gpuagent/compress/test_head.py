"""The recipe option head="int8" (gpuagent.compress.head): the demo model's tied
head written untied as group-32 int8 in its own config group, read back by
compressed-tensors within rounding and by transformers, loaded by the engine into
its int8 head kernel with the codes serve-time `quantize_head="int8"` makes, so the
greedy tokens are the same; refused by name where it does not apply."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpuagent.compress import compress
from gpuagent.compress.head import check_head_width
from gpuagent.compress.recipes import RecipeError
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.engine.weights import (
    Int8Head,
    QuantizedWeightError,
    quantize_head,
    split_quantized,
)
from tests.gpuagent.compress.conftest import DEMO_MODEL
from tests.gpuagent.compress.test_oracle import _decompressed

RECIPE = {"weights": "w4a16-g128", "kv_cache_dtype": "bf16"}
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The demo model compressed w4a16-g128 with the int8 head (layer by layer and
    in memory) and without it."""
    root = tmp_path_factory.mktemp("head")
    return {
        "int8": compress(DEMO_MODEL, RECIPE | {"head": "int8"}, root / "int8"),
        "in_memory": compress(
            DEMO_MODEL, RECIPE | {"head": "int8"}, root / "mem", sequential=False
        ),
        "bf16": compress(DEMO_MODEL, RECIPE, root / "bf16"),
    }


def _folder(folders, name) -> Path:
    return Path(folders[name].out_dir)


def test_it_writes_the_head_untied_in_its_own_config_group(folders):
    folder = _folder(folders, "int8")
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    source = load_file(DEMO_MODEL / "model.safetensors")
    qc = config["quantization_config"]

    assert config["tie_word_embeddings"] is False
    assert qc["ignore"] == []
    head_groups = [
        g for g in qc["config_groups"].values() if "re:^lm_head$" in g["targets"]
    ]
    assert len(head_groups) == 1 and head_groups[0]["targets"] == ["re:^lm_head$"]
    weights = head_groups[0]["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (
        8,
        "int",
        True,
    )
    assert (weights["strategy"], weights["group_size"]) == ("group", 32)
    assert "lm_head.weight" not in tensors
    assert tensors["lm_head.weight_scale"].dtype == torch.float32
    assert tensors["lm_head.weight_scale"].shape == (264, 256 // 32)
    # the embeddings are the source's, as the release without the option has them
    assert torch.equal(
        tensors["model.embed_tokens.weight"],
        source["model.embed_tokens.weight"].to(torch.bfloat16),
    )
    assert folders["int8"].quantized_layers == folders["bf16"].quantized_layers + 1


def test_both_compress_paths_write_the_same_tensors(folders):
    layered = load_file(_folder(folders, "int8") / "model.safetensors")
    in_memory = load_file(_folder(folders, "in_memory") / "model.safetensors")

    assert sorted(layered) == sorted(in_memory)
    assert all(torch.equal(layered[k], in_memory[k]) for k in layered)


def test_it_decompresses_with_compressed_tensors_within_rounding(folders):
    source = load_file(DEMO_MODEL / "model.safetensors")["model.embed_tokens.weight"]
    _, modules = _decompressed(_folder(folders, "int8"))

    head, state = modules["lm_head"]
    original = source.float()
    step = state["weight_scale"].float().repeat_interleave(32, 1)  # [264, 256]
    # half a step of round-to-nearest, plus the head's rounding to bf16 first
    bound = step * 0.5 * (1 + 2**-20) + original.abs() * 2**-8 + 1e-7
    error = (head.float() - original).abs()
    assert (error <= bound).all()
    assert error.max() > 0  # quantized, not the float head passed through


def test_the_engine_runs_the_codes_serve_time_quantize_head_makes(folders):
    served = load_model(_folder(folders, "int8"))
    flag = load_model(_folder(folders, "bf16"))
    quantize_head(flag, "int8")

    assert isinstance(served.lm_head, Int8Head)
    assert torch.equal(served.lm_head.codes, flag.lm_head.codes)
    assert torch.equal(served.lm_head.scale, flag.lm_head.scale)
    assert torch.equal(served.embed_tokens.weight, flag.embed_tokens.weight)


def test_greedy_tokens_equal_serve_time_quantize_head(folders):
    tokenizer = load_tokenizer(DEMO_MODEL)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    release = LLMEngine(load_model(_folder(folders, "int8")), tokenizer, num_blocks=32)
    flag = LLMEngine(
        load_model(_folder(folders, "bf16")),
        tokenizer,
        num_blocks=32,
        quantize_head="int8",
    )
    without = LLMEngine(load_model(_folder(folders, "bf16")), tokenizer, num_blocks=32)

    tokens = [o.token_ids for o in release.generate(PROMPTS, greedy)]

    assert isinstance(release.model.lm_head, Int8Head)
    assert tokens == [o.token_ids for o in flag.generate(PROMPTS, greedy)]
    assert all(len(t) == 24 for t in tokens)
    # the same logits, not the same model: the bf16 head's differ
    ids = torch.tensor([tokenizer.encode_prompt(PROMPTS[0])])
    with torch.no_grad():
        assert not torch.equal(
            release.model.forward_dense(ids), without.model.forward_dense(ids)
        )
        torch.testing.assert_close(
            release.model.forward_dense(ids),
            flag.model.forward_dense(ids),
            atol=1e-5,
            rtol=0,
        )


def test_it_loads_in_transformers(folders):
    from transformers import AutoModelForCausalLM

    folder = _folder(folders, "int8")
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = load_model(folder)
    with torch.no_grad():
        hf_logits = hf(tokens).logits
        our_logits = ours.forward_dense(tokens)

    assert not hf.config.tie_word_embeddings
    torch.testing.assert_close(hf_logits, our_logits, atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"head": "int4"}, "unknown head format 'int4'"),
        ({"weights": "bf16", "head": "int8"}, "needs quantized weights"),
        ({"weights": "fp8", "head": "int8"}, "int weight formats"),
        ({"quantize_lm_head": True, "head": "int8"}, "quantize_lm_head=true"),
    ],
)
def test_it_refuses_a_head_that_does_not_apply_by_name(tmp_path, options, says):
    with pytest.raises(RecipeError, match=says) as refused:
        compress(DEMO_MODEL, RECIPE | options, tmp_path / "out")

    assert "head" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_hidden_size_the_groups_do_not_divide_is_refused_naming_it():
    check_head_width(576)  # SmolLM2's: 18 groups of 32

    with pytest.raises(RecipeError, match="hidden_size=48"):
        check_head_width(48)


def test_on_smollm2_greedy_tokens_equal_serve_time_quantize_head(
    real_model_dir, tmp_path
):
    tokenizer = load_tokenizer(real_model_dir)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    release = compress(real_model_dir, RECIPE | {"head": "int8"}, tmp_path / "int8")
    without = compress(real_model_dir, RECIPE, tmp_path / "bf16")
    served = LLMEngine(load_model(release.out_dir), tokenizer, num_blocks=32)
    flag = LLMEngine(
        load_model(without.out_dir), tokenizer, num_blocks=32, quantize_head="int8"
    )
    prompts = ["The capital of France is", "def fibonacci(n):"]

    tokens = [o.token_ids for o in served.generate(prompts, greedy)]

    assert isinstance(served.model.lm_head, Int8Head)
    assert torch.equal(served.model.lm_head.codes, flag.model.lm_head.codes)
    assert torch.equal(served.model.lm_head.scale, flag.model.lm_head.scale)
    assert tokens == [o.token_ids for o in flag.generate(prompts, greedy)]


def test_the_engine_flag_on_a_release_with_its_head_is_refused_naming_why(folders):
    model = load_model(_folder(folders, "int8"))

    with pytest.raises(ValueError, match="already replaced .*Int8Head.*stored"):
        quantize_head(model, "int8")


def test_int8_groups_are_loaded_for_the_head_only(folders):
    tensors = load_file(_folder(folders, "int8") / "model.safetensors")
    config = json.loads((_folder(folders, "int8") / "config.json").read_text())
    qc = config["quantization_config"]
    head = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("lm_")}
    # the head's tensors under a projection's name, its group targeting them
    name = "model.layers.0.mlp.down_proj"
    moved = {f"{name}.{k}": v for k, v in head.items()}
    groups = qc["config_groups"]
    groups["group_0"]["targets"].remove(r"re:.*mlp\.down_proj$")
    groups["group_1"]["targets"] = ["re:.*down_proj$"]

    with pytest.raises(QuantizedWeightError, match=f"{name}: int8 must be per-channel"):
        split_quantized(moved, qc)


def test_an_moe_release_carries_its_int8_head_too(tmp_path):
    # the MoE demo (deepseek_v3, MLA + MoE, an untied head): the layer-by-layer
    # MoE path writes the head as the dense one does
    moe_demo = DEMO_MODEL.parent / "moe_demo_model"
    recipe = {"weights": "w4a16-g64", "kv_cache_dtype": "bf16"}
    release = compress(moe_demo, recipe | {"head": "int8"}, tmp_path / "int8")
    without = compress(moe_demo, recipe, tmp_path / "bf16")
    tokenizer = load_tokenizer(moe_demo)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    served = LLMEngine(load_model(release.out_dir), tokenizer, num_blocks=32)
    flag = LLMEngine(
        load_model(without.out_dir), tokenizer, num_blocks=32, quantize_head="int8"
    )

    tokens = [o.token_ids for o in served.generate(PROMPTS, greedy)]

    assert release.quantized_layers == without.quantized_layers + 1
    assert isinstance(served.model.lm_head, Int8Head)
    assert torch.equal(served.model.lm_head.codes, flag.model.lm_head.codes)
    assert torch.equal(served.model.lm_head.scale, flag.model.lm_head.scale)
    assert tokens == [o.token_ids for o in flag.generate(PROMPTS, greedy)]
