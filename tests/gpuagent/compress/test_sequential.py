"""The layer-by-layer compression path (gpuagent.compress.sequential): the same
tensors as the in-memory path for every method, sharded output, spilled
activations, and memory bounded by layers, not by the model."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpuagent.benches.compress_memory import (
    layer_params,
    measure,
    model_bytes,
    same_tensors,
    write_synthetic_llama,
)
from gpuagent.compress import RecipeError, compress
from gpuagent.compress.shard_writer import write_safetensors
from tests.gpuagent.compress.conftest import DEMO_MODEL, TEST_CALIBRATION

RECIPES = {
    "w8a16 rtn, fp8 kv": {"weights": "w8a16", "kv_cache_dtype": "fp8"},
    "w4a16 asym gptq": {
        "weights": "w4a16-g64",
        "kv_cache_dtype": "bf16",
        "method": "gptq",
        "symmetric": False,
    },
    "w8a16 awq gptq act-order mse, fp8 kv": {
        "weights": "w8a16",
        "kv_cache_dtype": "fp8",
        "method": "gptq",
        "awq": True,
        "act_order": True,
        "observer": "mse",
    },
    "w4a16 awq rtn": {"weights": "w4a16-g64", "kv_cache_dtype": "bf16", "awq": True},
    "w4a16 signround": {
        "weights": "w4a16-g64",
        "kv_cache_dtype": "bf16",
        "method": "signround",
    },
    "fp8 gptq": {"weights": "fp8", "kv_cache_dtype": "bf16", "method": "gptq"},
    "bf16, fp8 kv": {"weights": "bf16", "kv_cache_dtype": "fp8"},
}


def test_shards_are_save_files_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(3, 5, generator=g).bfloat16(),
        "a.weight_packed": torch.randint(-9, 9, (4, 2), dtype=torch.int32),
        "z.weight": torch.randn(7, generator=g).to(torch.float8_e4m3fn),
        "c.weight_shape": torch.tensor([3, 4]),
        "empty": torch.zeros(0),
        "é.scale": torch.ones(2, dtype=torch.float16),
        "q": torch.ones(3, dtype=torch.int8),
        "k_scale": torch.tensor([0.5]),
    }
    save_file(tensors, tmp_path / "reference", metadata={"format": "pt"})
    write_safetensors(tmp_path / "ours", tensors, {"format": "pt"})

    assert (tmp_path / "ours").read_bytes() == (tmp_path / "reference").read_bytes()


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_layerwise_writes_the_in_memory_paths_bytes(tmp_path, recipe):
    kv = {"kv_scale_strategy": "attn_head"} if "awq" in recipe else {}
    results = {
        sequential: compress(
            DEMO_MODEL,
            recipe,
            tmp_path / str(sequential),
            calibration_size=TEST_CALIBRATION,
            sequential=sequential,
            **kv,
        )
        for sequential in (False, True)
    }

    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "True" / name).read_bytes() == (
            tmp_path / "False" / name
        ).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "True").iterdir()) == sorted(
        p.name for p in (tmp_path / "False").iterdir()
    )
    old, new = (results[s].model_dump(exclude={"seconds", "out_dir"}) for s in (0, 1))
    assert new == old


def test_sharded_output_with_spilled_activations_loads_and_matches(tmp_path):
    from gpuagent.engine.loader import load_model

    recipe = RECIPES["w8a16 awq gptq act-order mse, fp8 kv"]
    compress(
        DEMO_MODEL,
        recipe,
        tmp_path / "memory",
        calibration_size=TEST_CALIBRATION,
        sequential=False,
    )
    compress(
        DEMO_MODEL,
        recipe,
        tmp_path / "layers",
        calibration_size=TEST_CALIBRATION,
        max_shard_bytes=300_000,
        spill_bytes=1,  # every layer's hidden states go through a file
    )

    folder = tmp_path / "layers"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    assert not list(folder.glob(".*"))  # no spilled or unnamed shard left
    held = {}
    for shard in shards:
        tensors = load_file(folder / shard)
        assert {n for n, s in index["weight_map"].items() if s == shard} == set(tensors)
        held |= tensors
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in held.values()
    )
    assert same_tensors(tmp_path / "memory", folder)
    load_model(folder)  # the engine reads the sharded folder


def test_layerwise_peak_memory_is_bounded_by_layers_not_the_model(tmp_path):
    # ~1.4 MB float32 layers; models of 16 and 64 of them (22 and 88 MB)
    shape = {
        "hidden_size": 128,
        "intermediate_size": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 264,
    }
    layer_bytes = layer_params(shape) * 4
    recipe = {"weights": "w8a16", "kv_cache_dtype": "bf16"}
    peaks, sizes = {}, {}
    for layers in (16, 64):
        source = tmp_path / f"source-{layers}"
        assert write_synthetic_llama(source, layers * layer_bytes, shape=shape) == (
            layers
        )
        sizes[layers] = model_bytes(source)
        out = tmp_path / f"layers-{layers}"
        peaks[layers] = measure(
            source, recipe, out, True, max_shard_bytes=4 * layer_bytes
        )["peak_over_baseline"]
    old = measure(source, recipe, tmp_path / "memory", False)["peak_over_baseline"]

    assert old > 1.5 * sizes[64]  # the whole model, in float32 and more
    # four times the layers (48 more, ~66 MB had the peak followed the model),
    # the same peak: one layer in float32, its quantization's temporaries, a
    # shard of output, and torch's fixed costs, give or take the allocator's
    # noise (CI read 4.3 layers more once)
    assert peaks[64] < peaks[16] + 8 * layer_bytes
    assert peaks[64] < 0.6 * sizes[64]
    assert same_tensors(tmp_path / "memory", tmp_path / "layers-64")


def test_a_model_several_times_a_memory_cap_compresses_under_it(tmp_path):
    # 64 layers of ~1.3 MB (~84 MB) under an address-space cap (RLIMIT_AS) of
    # 0.35x the model above the child's size after its imports: the layer path
    # fits, with the in-memory path's bytes; the in-memory path does not
    shape = {
        "hidden_size": 128,
        "intermediate_size": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 264,
    }
    layer_bytes = layer_params(shape) * 4
    source = tmp_path / "source"
    write_synthetic_llama(source, 64 * layer_bytes, shape=shape)
    cap = int(0.35 * model_bytes(source))
    recipe = {"weights": "w8a16", "kv_cache_dtype": "bf16"}

    capped = measure(
        source,
        recipe,
        tmp_path / "capped",
        True,
        cap_bytes=cap,
        max_shard_bytes=4 * layer_bytes,
    )
    in_memory_capped = measure(
        source, recipe, tmp_path / "memory-capped", False, cap_bytes=cap
    )
    measure(source, recipe, tmp_path / "memory", False)

    assert "memory_error" not in capped
    assert "memory_error" in in_memory_capped  # the cap bites
    assert same_tensors(tmp_path / "memory", tmp_path / "capped")


def test_sources_the_layer_path_does_not_take_are_named(tmp_path):
    from gpuagent.compress.sequential import SequentialUnsupported, check_source
    from gpuagent.engine.loader import ModelLoadError
    from gpuagent.integrity.streamed_load import open_inspected

    config = json.loads((DEMO_MODEL / "config.json").read_text())
    with open_inspected(DEMO_MODEL) as src:
        assert check_source(src, dict(config)).num_hidden_layers == 4
        with pytest.raises(SequentialUnsupported, match="already quantized"):
            check_source(src, config | {"quantization_config": {}})
        with pytest.raises(ModelLoadError, match="missing tensors"):
            check_source(src, config | {"num_hidden_layers": 5})


@pytest.mark.parametrize("sequential", [False, True])
def test_signround_runs_the_steps_asked_on_either_path(tmp_path, sequential):
    recipe = RECIPES["w4a16 signround"]
    source = load_file(DEMO_MODEL / "model.safetensors")
    codes = {}
    for steps in (0, 8):
        out = tmp_path / str(steps)
        compress(
            DEMO_MODEL,
            recipe,
            out,
            calibration_size=TEST_CALIBRATION,
            sequential=sequential,
            signround_steps=steps,
        )
        codes[steps] = load_file(out / "model.safetensors")

    # no step: each group rounded to nearest on its full-range signed scale,
    # whatever the layer's inputs; some steps move some codes
    name = "model.layers.2.mlp.down_proj"
    w = source[name + ".weight"].float()
    groups = w.view(w.shape[0], -1, 64)
    neg = -groups.amin(-1, keepdim=True).clamp(max=0)
    pos = groups.amax(-1, keepdim=True).clamp(min=0)
    scale = torch.where(neg >= pos, neg / 8, -pos / 8).bfloat16()
    assert torch.equal(codes[0][name + ".weight_scale"], scale[..., 0])
    packed = [k for k in codes[0] if k.endswith(".weight_packed")]
    assert any(not torch.equal(codes[0][k], codes[8][k]) for k in packed)
    with pytest.raises(RecipeError, match="signround_steps=-1 must be >= 0"):
        compress(DEMO_MODEL, recipe, tmp_path / "x", signround_steps=-1)
