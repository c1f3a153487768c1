"""The compressed folders are what vLLM loads: every quantization_config parses
with compressed-tensors, fp8 KV scales always come with their kv_cache_scheme (also
on bf16 weights), per tensor unless per head is asked for, both `dtype` and
`torch_dtype` name the weights written, and int4 groups are ones vLLM's kernels
take."""

import json
import shutil

import pytest
import torch
from compressed_tensors import QuantizationConfig
from safetensors.torch import load_file

from gpuagent.compress import RecipeError, compress
from gpuagent.compress.recipes import weight_scheme
from gpuagent.engine.loader import load_model
from gpuagent.serving.verify import check_weight_format
from tests.gpuagent.compress.conftest import DEMO_MODEL, TEST_CALIBRATION

BF16_FP8_KV = {"weights": "bf16", "kv_cache_dtype": "fp8"}


@pytest.fixture(scope="module")
def fp8_kv(tmp_path_factory) -> dict[str, tuple]:
    """bf16 weights with fp8 KV scales, per tensor (the default) and per head:
    (folder, CompressResult) each."""
    root = tmp_path_factory.mktemp("fp8kv")
    made = {}
    for strategy in ("tensor", "attn_head"):
        out = root / strategy
        kw = {} if strategy == "tensor" else {"kv_scale_strategy": strategy}
        result = compress(
            DEMO_MODEL, BF16_FP8_KV, out, calibration_size=TEST_CALIBRATION, **kw
        )
        made[strategy] = (out, result)
    return made


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_every_compressed_config_parses_with_compressed_tensors(
    compressed_demo, fp8_kv
):
    folders = [*compressed_demo.values(), *(f for f, _ in fp8_kv.values())]

    for folder in folders:
        raw = config_of(folder)["quantization_config"]
        parsed = QuantizationConfig.model_validate(raw)

        assert parsed.quant_method == "compressed-tensors", folder
        for name, group in raw["config_groups"].items():
            assert (
                parsed.config_groups[name].weights.group_size
                == (group["weights"]["group_size"])
            )
        assert (parsed.kv_cache_scheme is None) == (raw["kv_cache_scheme"] is None)


def test_bf16_weights_with_fp8_kv_declare_the_scales_in_a_kv_only_config(fp8_kv):
    folder, result = fp8_kv["tensor"]

    quant = config_of(folder)["quantization_config"]
    parsed = QuantizationConfig.model_validate(quant)
    tensors = load_file(folder / "model.safetensors")

    # llm-compressor's shape of a KV-cache-only recipe: no groups, the scheme
    assert quant["config_groups"] == {} and quant["format"] == "dense"
    assert parsed.kv_cache_scheme.strategy == "tensor"
    assert (
        parsed.kv_cache_scheme.type == "float" and parsed.kv_cache_scheme.num_bits == 8
    )
    assert "model.layers.0.self_attn.k_scale" in tensors
    assert all(t.dtype != torch.int32 for t in tensors.values())  # weights stay dense
    assert result.kv_scales and result.kv_scale_strategy == "tensor"
    # the serving check takes it as bf16 weights, and our engine loads its scales
    assert check_weight_format(folder, "bf16").quantized
    assert load_model(folder).checkpoint_kv_scales is not None


def test_kv_scales_are_per_tensor_unless_per_head_is_asked_for(fp8_kv):
    per_tensor = load_file(fp8_kv["tensor"][0] / "model.safetensors")
    per_head = load_file(fp8_kv["attn_head"][0] / "model.safetensors")
    scheme = config_of(fp8_kv["attn_head"][0])["quantization_config"]

    assert scheme["kv_cache_scheme"]["strategy"] == "attn_head"
    assert fp8_kv["attn_head"][1].kv_scale_strategy == "attn_head"
    for layer in range(4):
        for kind in ("k_scale", "v_scale"):
            name = f"model.layers.{layer}.self_attn.{kind}"
            assert per_tensor[name].shape == (1,), name
            assert per_head[name].shape == (2, 1, 1), name  # 2 kv heads
            # the layer's absmax over all heads is the largest head's
            assert torch.equal(per_tensor[name], per_head[name].max().reshape(1))


def test_an_unknown_kv_scale_strategy_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="unknown KV scale strategy 'head'"):
        compress(DEMO_MODEL, BF16_FP8_KV, tmp_path / "o", kv_scale_strategy="head")

    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("recipe", "dtype"),
    [
        ({"weights": "fp16", "kv_cache_dtype": "bf16"}, "float16"),
        ({"weights": "w8a16", "kv_cache_dtype": "bf16"}, "bfloat16"),
    ],
)
def test_both_dtype_and_torch_dtype_name_the_weights_written(tmp_path, recipe, dtype):
    # transformers 5 and vLLM read `dtype` first: a source's own must not win
    source = tmp_path / "source"
    shutil.copytree(DEMO_MODEL, source)
    config = config_of(source) | {"dtype": "float32"}
    (source / "config.json").write_text(json.dumps(config))

    compress(source, recipe, tmp_path / "out")

    written = config_of(tmp_path / "out")
    assert written["dtype"] == written["torch_dtype"] == dtype


@pytest.mark.parametrize(
    ("weights", "width", "group"),
    [
        ("w4a16-g128", 576, 64),  # SmolLM2's hidden size
        ("w4a16-g128", 1536, 128),
        ("w4a16-g64", 96, 32),
    ],
)
def test_int4_groups_fall_back_only_to_sizes_vllm_takes(weights, width, group):
    scheme = weight_scheme({"weights": weights, "kv_cache_dtype": "bf16"})

    assert scheme.group_size_for(width) == group


def test_a_width_no_vllm_group_divides_is_refused_naming_the_way_out():
    scheme = weight_scheme({"weights": "w4a16-g128", "kv_cache_dtype": "bf16"})

    # 48 = 16 * 3: a group of 16 is what the old fallback wrote
    with pytest.raises(RecipeError) as info:
        scheme.group_size_for(48)

    assert "in_features=48" in str(info.value) and "w8a16" in str(info.value)
