"""Shared by the compression tests."""

import torch

from tests.gpuagent.conftest import DEMO_MODEL, TEST_CALIBRATION  # noqa: F401


def demo_layer_inputs(seed: int):
    """Layer 1 of the demo model and its inputs on random tokens: (layer, hidden,
    cos, sin), hidden [4, 48, hidden] from layer 0."""
    from gpuagent.engine.loader import load_model

    model = load_model(DEMO_MODEL)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (4, 48), generator=g)
    with torch.no_grad():
        cos, sin = model._rope(torch.arange(48))
        hidden = model.layers[0].forward_dense(model.embed_tokens(tokens), cos, sin)
    return model.layers[1], hidden, cos, sin
