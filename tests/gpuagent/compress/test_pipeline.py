import pickle
import shutil

import pytest
import torch

from gpuagent.compress import CompressError, RecipeError, compress
from tests.gpuagent.compress.conftest import DEMO_MODEL


def test_it_copies_tokenizer_and_generation_config_unchanged(compressed_demo):
    out = compressed_demo["w8a16"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (DEMO_MODEL / name).read_bytes()


def test_it_reports_progress_per_layer_and_sizes(tmp_path):
    seen = []

    result = compress(
        DEMO_MODEL,
        {"weights": "w4a16-g128", "kv_cache_dtype": "bf16"},
        tmp_path / "out",
        progress=lambda done, total, what: seen.append((done, total)),
    )

    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert result.quantized_layers == 28
    sizes = {s.tensor_class: s for s in result.sizes}
    assert sizes["mlp"].bytes_after / sizes["mlp"].bytes_bf16 <= 0.28
    assert sizes["embeddings"].bytes_after == sizes["embeddings"].bytes_bf16


def test_it_refuses_a_source_with_a_pickle_file(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(DEMO_MODEL, source)
    (source / "extra.bin").write_bytes(pickle.dumps({"a": 1}))

    with pytest.raises(CompressError, match="failed inspection"):
        compress(source, {"weights": "w8a16", "kv_cache_dtype": "bf16"}, tmp_path / "o")

    assert not (tmp_path / "o").exists()


def test_it_leaves_nothing_when_interrupted(tmp_path):
    def interrupt(done, total, what):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compress(
            DEMO_MODEL,
            {"weights": "w8a16", "kv_cache_dtype": "bf16"},
            tmp_path / "out",
            progress=interrupt,
        )

    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sequential", [True, False])
def test_it_leaves_nothing_when_writing_fails(tmp_path, monkeypatch, sequential):
    import gpuagent.compress.pipeline as pipeline
    import gpuagent.compress.shard_writer as shard_writer

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pipeline, "save_file", broken_save)
    monkeypatch.setattr(shard_writer, "write_safetensors", broken_save)
    with pytest.raises(OSError, match="disk full"):
        compress(
            DEMO_MODEL,
            {"weights": "fp8", "kv_cache_dtype": "bf16"},
            tmp_path / "o",
            sequential=sequential,
            max_shard_bytes=100_000,  # the first shard fails mid-run
        )

    assert list(tmp_path.iterdir()) == []


def test_it_refuses_an_existing_output(tmp_path):
    (tmp_path / "out").mkdir()

    with pytest.raises(CompressError, match="already exists"):
        compress(
            DEMO_MODEL, {"weights": "fp8", "kv_cache_dtype": "bf16"}, tmp_path / "out"
        )


@pytest.mark.parametrize(
    ("recipe", "named"),
    [
        ({"weights": "w8a16", "kv_cache_dtype": "bf16", "clip": "mse"}, "clip"),
        ({"weights": "w8a16", "kv_cache_dtype": "bf16", "method": "awq"}, "method"),
        ({"weights": "w8a16", "kv_cache_dtype": "bf16", "symmetric": False}, "symm"),
        ({"weights": "fp8", "kv_cache_dtype": "bf16", "symmetric": False}, "symm"),
        ({"weights": "w8a16", "kv_cache_dtype": "bf16", "act_order": True}, "act_"),
        ({"weights": "fp8", "kv_cache_dtype": "bf16", "observer": "mse"}, "observer"),
        ({"weights": "bf16", "kv_cache_dtype": "bf16", "observer": "mse"}, "observer"),
        ({"weights": "w8a16", "kv_cache_dtype": "bf16", "observer": "max"}, "observer"),
        (
            {"weights": "w8a16", "kv_cache_dtype": "bf16", "quantize_lm_head": True},
            "tied",
        ),
    ],
)
def test_it_refuses_recipes_it_cannot_apply(tmp_path, recipe, named):
    with pytest.raises(RecipeError, match=named):
        compress(DEMO_MODEL, recipe, tmp_path / "out")

    assert not (tmp_path / "out").exists()


def test_it_writes_a_bf16_folder_for_a_dense_recipe(tmp_path):
    from gpuagent.engine.loader import load_model

    result = compress(
        DEMO_MODEL, {"weights": "bf16", "kv_cache_dtype": "bf16"}, tmp_path / "o"
    )

    model = load_model(tmp_path / "o")
    assert result.quantized_layers == 0
    assert result.total_bytes_after * 2 == result.total_bytes_before  # fp32 -> bf16
    assert "quantization_config" not in (tmp_path / "o" / "config.json").read_text()
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float32
