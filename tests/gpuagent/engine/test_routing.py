"""The routing recorder: every MoE layer hands it the ids its router chose, the
forward's logits are the same with it as without, and nothing is recorded for the
dense layers or when none is given."""

import torch

from gpuagent.engine.loader import load_model
from gpuagent.engine.routing import RoutingRecorder
from tests.gpuagent.engine.test_moe_archs import deepseek_folder


def test_it_records_each_moe_layers_router_choice(tmp_path):
    deepseek_folder(tmp_path, n_routed_experts=16, num_experts_per_tok=4)
    model = load_model(tmp_path)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    chosen = {}  # the router's own output, caught at the router

    def catch(layer):
        def hook(_module, _args, out):
            chosen[layer] = out[1]

        return hook

    hooks = [
        model.layers[i].mlp.gate.register_forward_hook(catch(i))
        for i in model.moe_layers
    ]
    routing = RoutingRecorder()
    with torch.no_grad():
        recorded = model.forward_dense(tokens, routing)
        for hook in hooks:
            hook.remove()
        plain = model.forward_dense(tokens)

    assert torch.equal(recorded, plain)
    assert model.moe_layers == [1, 2] and routing.layers == [1, 2]
    for i in routing.layers:
        ids = routing.expert_ids(i)
        assert ids.shape == (2 * 9, 4) and ids.dtype == torch.int32
        assert torch.equal(ids, chosen[i].int())


def test_nothing_is_recorded_without_a_recorder(tmp_path, monkeypatch):
    deepseek_folder(tmp_path)
    model = load_model(tmp_path)
    calls = []
    monkeypatch.setattr(RoutingRecorder, "record", lambda *a: calls.append(a))

    with torch.no_grad():
        model.forward_dense(torch.tensor([[1, 2, 3]]))

    assert calls == []
