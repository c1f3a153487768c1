"""The per-expert GPTQ bench's measurement: each routed expert scored on the
tokens the source router sends it."""

import torch

from gpuagent.benches.moe_gptq import expert_errors, mlp_inputs
from gpuagent.engine.loader import load_model
from tests.gpuagent.engine.test_moe_archs import glm_folder


def test_expert_errors_are_zero_for_the_source_and_grow_with_a_perturbation(
    tmp_path,
):
    glm_folder(tmp_path, vocab_size=97)
    source, candidate = load_model(tmp_path), load_model(tmp_path)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    inputs = mlp_inputs(source, tokens)
    assert sorted(inputs) == [1, 2]  # the MoE layers (first_k_dense_replace=1)
    assert inputs[1].shape == (48, 64)

    same = expert_errors(source, candidate, inputs)
    assert all(err == 0 and ref > 0 for err, ref in same.values())

    _, ids = source.layers[2].mlp.gate(inputs[2])
    busiest = int(torch.bincount(ids.reshape(-1)).argmax())
    with torch.no_grad():  # one routed expert of layer 2 changed: only layer 2 moves
        candidate.layers[2].mlp.experts[busiest].down_proj.weight.mul_(1.1)
    moved = expert_errors(source, candidate, inputs)
    assert moved[1][0] == 0 and moved[2][0] > 0
