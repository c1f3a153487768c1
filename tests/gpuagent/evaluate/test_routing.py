"""Router agreement and expert-load shift: the metrics on hand-made choices, and end
to end on a tiny random DeepSeek-V3 folder (written by transformers, the demo
model's byte tokenizer beside it) against itself and against copies whose router
was changed, checked against the agreement computed by hand from transformers'
router inputs."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.routing import RoutingRecorder
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.evaluate import Endpoint, EngineModel, Settings, evaluate_quality
from gpuagent.evaluate.__main__ import main
from gpuagent.evaluate.evalsets import load_text_slices
from gpuagent.evaluate.routing import (
    RoutingTally,
    expert_load,
    expert_set_jaccard,
    load_shift,
    max_load_change,
    same_expert_set,
)
from gpuagent.protocol import LayerRouting, RoutingReport
from tests.gpuagent.conftest import DEMO_MODEL
from tests.gpuagent.engine.test_moe_archs import deepseek_folder
from tests.gpuagent.serving import serve

NUM_EXPERTS, TOP_K = 16, 4
QUICK = Settings(
    seed=0,
    continuation_tokens=2,
    passage_tokens=64,
    slices=("english", "code"),
    max_items=2,
)

# ------------------------------------------------------------------ the metrics


def test_it_compares_expert_sets_not_their_order():
    cand = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    ref = torch.tensor([[2, 0, 1], [3, 4, 6], [0, 1, 2]])

    assert same_expert_set(cand, ref).tolist() == [True, False, False]
    torch.testing.assert_close(
        expert_set_jaccard(cand, ref, 9), torch.tensor([1.0, 2 / 4, 0 / 6])
    )


def test_load_shift_is_the_total_variation_of_the_expert_shares():
    cand = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]])  # loads 4 2 1 1
    ref = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])  # loads 2 2 2 2

    c, r = expert_load(cand, 4), expert_load(ref, 4)
    change, expert = max_load_change(c, r)

    assert c.tolist() == [4, 2, 1, 1] and r.tolist() == [2, 2, 2, 2]
    # shares 1/2 1/4 1/8 1/8 against 1/4 each: (1/4 + 0 + 1/8 + 1/8) / 2
    assert load_shift(c, r) == pytest.approx(0.25)
    assert (change, expert) == (pytest.approx(1.0), 0)  # 4 vs 2
    assert load_shift(r, r) == 0 and max_load_change(r, r)[0] == 0


def test_a_cold_expert_changes_relative_to_the_mean_load():
    ref = torch.tensor([40, 40, 0, 0])  # mean 20
    cand = torch.tensor([40, 38, 2, 0])

    change, expert = max_load_change(cand, ref)

    assert (change, expert) == (pytest.approx(2 / 20), 2)  # not 2 / 0


def test_a_report_can_not_claim_a_better_worst_layer():
    layers = [
        LayerRouting(
            layer=i,
            num_tokens=10,
            router_agreement=a,
            mean_jaccard=a,
            load_shift=s,
            max_load_change=0.1,
            max_load_change_expert=0,
        )
        for i, a, s in ((1, 0.9, 0.01), (2, 0.7, 0.05))
    ]
    report = RoutingReport.measured(layers, 16, 4)
    assert report.min_router_agreement == 0.7 and report.worst_agreement_layer == 2

    data = report.model_dump() | {"min_router_agreement": 0.9}
    with pytest.raises(ValueError, match="must be the worst over the layers"):
        RoutingReport.model_validate(data)
    with pytest.raises(ValueError, match="carries no numbers"):
        RoutingReport(status="unknown", reason="x", min_router_agreement=1.0)
    with pytest.raises(ValueError, match="says why"):
        RoutingReport(status="not_applicable")


def test_recordings_of_other_layers_or_tokens_are_refused():
    a, b = RoutingRecorder(), RoutingRecorder()
    a.record(1, torch.tensor([[0, 1]]))
    b.record(2, torch.tensor([[0, 1]]))

    with pytest.raises(ValueError, match="not the same architecture"):
        RoutingTally(4, 2).add(a, b)
    b.clear()
    b.record(1, torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(ValueError, match="not the same tokens"):
        RoutingTally(4, 2).add(a, b)


# -------------------------------------------------------- a tiny MoE end to end


def moe_folder(path: Path, **overrides):
    """A tiny random DeepSeek-V3 (3 layers, the first dense; 16 experts, top-4,
    no groups) with the demo model's tokenizer; returns transformers' model."""
    path.mkdir(parents=True, exist_ok=True)
    hf = deepseek_folder(
        path,
        vocab_size=264,
        n_routed_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=1,
        topk_group=1,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **overrides,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, path / name)
    return hf


def changed_copy(parent: Path, path: Path, edit) -> Path:
    """`parent` copied to `path` with `edit(tensors)` applied to its weights."""
    shutil.copytree(parent, path)
    tensors = load_file(parent / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def bias_of(layer):
    return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"


def gate_of(layer):
    return f"model.layers.{layer}.mlp.gate.weight"


def perturb_bias(tensors):
    gen = torch.Generator().manual_seed(7)
    bias = tensors[bias_of(2)]
    tensors[bias_of(2)] = bias + 0.05 * torch.randn(bias.shape, generator=gen)


def perturb_gate(tensors):
    gen = torch.Generator().manual_seed(8)
    w = tensors[gate_of(1)]
    tensors[gate_of(1)] = w + 0.3 * w.std() * torch.randn(w.shape, generator=gen)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    hf = moe_folder(root / "parent")
    return {
        "hf": hf,
        "parent": root / "parent",
        "bias": changed_copy(root / "parent", root / "bias", perturb_bias),
        "gate": changed_copy(root / "parent", root / "gate", perturb_gate),
    }


@pytest.fixture(scope="module")
def parent(folders):
    return EngineModel(folders["parent"], "fp32", max_tokens=256)


def hand_reference(folders, parent, edit, layer):
    """Agreement and loads of `layer` computed by hand: the router inputs of every
    scored token from transformers' parent model (the layer's input is the same in
    both models: only this layer's router was changed), top-k of sigmoid scores
    plus bias as plain sets, for the parent's router and for the edited one."""
    tensors = load_file(folders["parent"] / "model.safetensors")
    edited = dict(tensors)
    edit(edited)
    inputs = []
    gate = folders["hf"].model.layers[layer].mlp.gate
    hook = gate.register_forward_hook(lambda _m, args, _out: inputs.append(args[0]))
    try:
        for s in QUICK.slices:
            (wanted,) = [x for x in load_text_slices() if x.name == s]
            for passage in wanted.passages[: QUICK.max_items]:
                ids = parent.encode(passage)[: QUICK.passage_tokens]
                with torch.no_grad():
                    folders["hf"](torch.tensor([ids]))
    finally:
        hook.remove()
    x = torch.cat([i.reshape(-1, i.shape[-1]) for i in inputs]).float()

    def choices(weights):
        w, b = weights[gate_of(layer)], weights[bias_of(layer)]
        scores = torch.sigmoid(x @ w.float().T) + b.float()
        return [set(row) for row in scores.topk(TOP_K, dim=-1).indices.tolist()]

    ref, cand = choices(tensors), choices(edited)
    agreement = sum(a == b for a, b in zip(cand, ref, strict=True)) / len(ref)
    load_r = Counter(e for row in ref for e in row)
    load_c = Counter(e for row in cand for e in row)
    slots = len(ref) * TOP_K
    shift = sum(abs(load_c[e] - load_r[e]) for e in range(NUM_EXPERTS)) / 2 / slots
    return agreement, shift, len(ref)


def test_a_prompt_prefilled_in_chunks_records_every_token_in_order(folders):
    side = EngineModel(folders["parent"], "fp32", max_tokens=256)
    side.engine.scheduler.max_num_batched_tokens = 32  # 100 tokens: 4 chunks
    ids = torch.randint(0, 264, (100,), generator=torch.Generator().manual_seed(5))
    chunked, whole = RoutingRecorder(), RoutingRecorder()

    chunks = list(side.logprobs_chunks(ids.tolist(), chunked))
    with torch.no_grad():
        side.engine.model.forward_dense(ids[None], whole)

    assert [c.shape[0] for c in chunks] == [32, 32, 32, 4]
    assert chunked.layers == whole.layers == [1, 2]
    for layer in whole.layers:
        paged, dense = chunked.expert_ids(layer), whole.expert_ids(layer)
        assert paged.shape == (100, TOP_K)
        # the paged cache and plain attention round differently: a near tie may
        # swap, nothing more
        agreement = same_expert_set(paged, dense).float().mean().item()
        print(f"layer {layer}: chunked vs whole {agreement:.4f}")
        assert agreement >= 0.98


def test_a_model_against_itself_agrees_everywhere(folders, parent):
    again = EngineModel(folders["parent"], "fp32", max_tokens=256)

    routing = evaluate_quality(again, parent, QUICK).routing

    assert routing.status == "measured"
    assert (routing.num_experts, routing.top_k) == (NUM_EXPERTS, TOP_K)
    assert [e.layer for e in routing.layers] == [1, 2]  # layer 0 is dense
    for e in routing.layers:
        assert e.router_agreement == 1 and e.mean_jaccard == 1
        assert e.load_shift == 0 and e.max_load_change == 0
        assert e.num_tokens > 100
    assert routing.min_router_agreement == 1 and routing.max_load_shift == 0


@pytest.mark.parametrize(
    ("changed", "edit", "layer"),
    [("bias", perturb_bias, 2), ("gate", perturb_gate, 1)],
    ids=["correction-bias-of-layer-2", "gate-weights-of-layer-1"],
)
def test_a_changed_router_agrees_less_as_computed_by_hand(
    folders, parent, changed, edit, layer
):
    candidate = EngineModel(folders[changed], "fp32", max_tokens=256)

    routing = evaluate_quality(candidate, parent, QUICK).routing
    agreement, shift, tokens = hand_reference(folders, parent, edit, layer)

    by_layer = {e.layer: e for e in routing.layers}
    measured = by_layer[layer]
    print(
        f"{changed}: layer {layer} agreement {measured.router_agreement:.4f} "
        f"(by hand {agreement:.4f}), load shift {measured.load_shift:.4f} "
        f"(by hand {shift:.4f}), {tokens} tokens"
    )
    assert measured.num_tokens == tokens
    assert 0 < measured.router_agreement < 1
    assert measured.router_agreement == pytest.approx(agreement, abs=1e-9)
    assert measured.load_shift == pytest.approx(shift, abs=1e-9)
    assert measured.mean_jaccard < 1 and measured.max_load_change > 0
    ci = measured.router_agreement_ci95
    assert ci.low < measured.router_agreement < ci.high
    assert routing.min_router_agreement == measured.router_agreement
    # the layers before the changed router route as the parent does
    assert all(e.router_agreement == 1 for e in routing.layers if e.layer < layer)


def test_a_dense_model_is_marked_not_applicable():
    demo = EngineModel(DEMO_MODEL, "fp32", max_tokens=256)
    settings = Settings(
        continuation_tokens=1, passage_tokens=16, slices=("english",), max_items=1
    )

    routing = evaluate_quality(demo, demo, settings).routing

    assert routing.status == "not_applicable"
    assert "dense" in routing.reason and routing.min_router_agreement is None


def test_over_http_a_moe_models_routing_is_unknown_never_measured(folders, parent):
    model = load_model(folders["bias"])
    engine = LLMEngine(model, load_tokenizer(folders["bias"]), num_blocks=40)
    settings = Settings(
        continuation_tokens=1, passage_tokens=32, slices=("english",), max_items=1
    )

    with serve(engine, "moe") as (url, _):
        report = evaluate_quality(Endpoint(url), parent, settings)

    assert report.method == "http_top_n"
    assert report.routing.status == "unknown" and not report.routing.layers
    assert "not visible" in report.routing.reason


def test_the_cli_prints_each_layer_and_writes_them(folders, tmp_path, capsys):
    out = tmp_path / "report.json"

    main(
        [
            "--candidate",
            str(folders["bias"]),
            "--reference",
            str(folders["parent"]),
            "--slices",
            "english",
            "--max-items",
            "1",
            "--passage-tokens",
            "48",
            "--continuation-tokens",
            "1",
            "--long-context-tokens",
            "256",
            "--json",
            str(out),
        ]
    )

    printed = capsys.readouterr().out
    assert "routing: top-4 of 16 experts" in printed
    assert "worst: agreement" in printed
    rows = [line.split()[0] for line in printed.splitlines()[-3:-1]]
    assert rows == ["1", "2"]
    written = json.loads(out.read_text())["routing"]
    assert written["status"] == "measured" and len(written["layers"]) == 2
