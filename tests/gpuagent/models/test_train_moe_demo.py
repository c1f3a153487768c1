"""`train_moe_demo`: training is a function of the seed (the saved folder's bytes
included), the auxiliary-loss-free balancing moves the correction bias toward
underloaded experts, and the folder is written as the published DeepSeek-V3
checkpoints are (sharded with an index, bf16 with the bias in float32).

The committed MoE demo folder is only read here; runs write to tmp_path.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from gpuagent.engine.arch import MoEConfig
from gpuagent.engine.loader import load_model
from gpuagent.models import train_moe_demo

TINY = {
    **train_moe_demo.moe_demo_hf_config(),
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "max_position_embeddings": 64,
}


@pytest.fixture(autouse=True)
def restore_torch_globals():
    """`train` seeds torch's global generator and turns deterministic algorithms on
    for the process; put both back for the tests that run after these."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        yield
    torch.use_deterministic_algorithms(deterministic)


def tiny_folder(corpus, seed: int, out) -> dict:
    model, stats = train_moe_demo.train(
        seed,
        steps=4,
        batch=2,
        seq_len=16,
        peak_lr=3e-3,
        bias_update_speed=1e-2,
        log_every=10,
        corpus=corpus,
        hf_config=TINY,
    )
    stats.pop("train_seconds")
    train_moe_demo.save_model_folder(model, TINY, out, dict(stats))
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_it_writes_the_same_bytes_from_the_same_seed(corpus, tmp_path):
    first = tiny_folder(corpus, 0, tmp_path / "a")
    again = tiny_folder(corpus, 0, tmp_path / "b")
    other = tiny_folder(corpus, 1, tmp_path / "c")

    assert first == again
    shards = [n for n in first if n.endswith(".safetensors")]
    assert len(shards) == 2
    assert any(first[n] != other[n] for n in shards)


def test_it_moves_each_layers_correction_bias_during_training(corpus, tmp_path):
    tiny_folder(corpus, 0, tmp_path / "m")

    biases = []
    with safe_open(tmp_path / "m" / "model-00002-of-00002.safetensors", "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if name.endswith("e_score_correction_bias"):
                biases.append(f.get_tensor(name))

    assert biases  # layer 1 is a MoE layer (first_k_dense_replace 1)
    for bias in biases:
        assert bias.dtype == torch.float32
        # 4 steps of +-0.01 (0 at exactly the mean load): multiples of the speed
        assert bias.abs().max() > 0
        steps = bias / 1e-2
        assert torch.allclose(steps, steps.round(), atol=1e-4)


def test_the_balancing_step_favours_the_underloaded_expert():
    model = train_moe_demo.MoETransformer(MoEConfig.from_hf_config(TINY))
    load = train_moe_demo.ExpertLoad(model)
    router = load.routers[0]
    # every token to experts 0 and 1: they are above the mean, the rest below
    forced = torch.zeros(router.config.num_experts)
    forced[:2] = 100.0
    router.e_score_correction_bias.copy_(forced)

    with torch.no_grad():
        model.forward_dense(torch.randint(0, 256, (1, 8)))
    load.update_biases(0.5)

    moved = router.e_score_correction_bias - forced
    assert moved[:2].tolist() == [-0.5, -0.5]
    assert (moved[2:] == 0.5).all()
    assert load.shares()[0][:2] == [0.5, 0.5]


def test_the_saved_folder_has_an_index_covering_every_tensor(corpus, tmp_path):
    tiny_folder(corpus, 0, tmp_path / "m")
    folder = tmp_path / "m"
    index = json.loads((folder / train_moe_demo.INDEX_FILE).read_text())

    found = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(folder / shard, "pt") as f:
            found.update({name: shard for name in f.keys()})  # noqa: SIM118

    assert found == index["weight_map"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"
    assert config["torch_dtype"] == "bfloat16"
    assert load_model(folder).num_parameters() > 0


def test_the_shipped_moe_model_was_trained_on_the_demo_llamas_corpus(committed_report):
    moe_report = train_moe_demo.read_committed_report(train_moe_demo.COMMITTED_DIR)

    assert moe_report is not None
    assert moe_report["corpus_sha256"] == committed_report["corpus_sha256"]
    assert moe_report["seed"] == 0 and moe_report["torch_threads"] == 1
