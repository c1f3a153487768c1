"""AWQ scales: folding them leaves a layer's output unchanged, the search never
does worse than no scaling on its own objective, and it helps where inputs carry
loud channels; an awq recipe writes a folder the engine loads within the bars."""

import pytest
import torch

from gpuagent.compress import compress
from gpuagent.compress.awq import _fold_into_norm, scale_layer, search_scales
from gpuagent.compress.checkpoint import DENSE_DTYPE
from gpuagent.compress.quantize import quantize_rtn
from gpuagent.compress.recipes import RecipeError, weight_scheme
from gpuagent.engine.loader import load_model
from tests.gpuagent.compress.conftest import (
    DEMO_MODEL,
    TEST_CALIBRATION,
    demo_layer_inputs,
)

W8 = weight_scheme({"weights": "w8a16", "kv_cache_dtype": "bf16"})
W4 = weight_scheme({"weights": "w4a16-g32", "kv_cache_dtype": "bf16"})


def _loud_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(4096, 128, generator=g)
    x[:, :3] *= 30  # a few loud channels, as activations have
    return w, x


def _error(x, w, scaled_w, s):
    return ((x @ w.t() - (x / s) @ scaled_w.t()) ** 2).mean().item()


@pytest.mark.parametrize("scheme", [W8, W4], ids=["w8a16", "w4a16-g32"])
def test_the_search_beats_no_scaling_on_loud_inputs(scheme):
    w, x = _loud_inputs()

    s, alpha = search_scales(x, [w], scheme)

    plain = _error(x, w, quantize_rtn(w, scheme).dequantize(), torch.ones(128))
    scaled = _error(x, w, quantize_rtn(w * s, scheme).dequantize(), s)
    assert alpha > 0 and scaled < 0.7 * plain, (alpha, scaled, plain)


def test_the_search_keeps_no_scaling_when_inputs_are_even():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.ones(256, 128)  # every channel the same: nothing to gain

    s, alpha = search_scales(x, [w], W8)

    assert alpha == 0 and torch.allclose(s, torch.ones(128))


def test_folding_the_scales_leaves_the_layer_output_unchanged():
    layer, hidden, cos, sin = demo_layer_inputs(seed=2)
    with torch.no_grad():
        before = layer.forward_dense(hidden, cos, sin)
        norm_before = layer.input_layernorm.weight.clone()

        picked = scale_layer(layer, hidden, cos, sin, W4)
        after = layer.forward_dense(hidden, cos, sin)

    assert any(alpha > 0 for alpha in picked.values())  # something was scaled
    assert not torch.equal(layer.input_layernorm.weight, norm_before) or (
        picked["self_attn.q_proj"] == 0
    )
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    for norm, first in (
        ("input_layernorm", "self_attn.q_proj"),
        ("post_attention_layernorm", "mlp.gate_proj"),
    ):
        if picked[first] > 0:  # the folded norm is what the checkpoint keeps
            weight = layer.get_submodule(norm).weight
            assert torch.equal(weight, weight.to(DENSE_DTYPE).to(weight.dtype)), norm


def test_a_norm_folds_to_its_stored_dtype_and_the_applied_scales_keep_the_product():
    g = torch.Generator().manual_seed(4)
    norm = torch.rand(96, generator=g) + 0.5
    norm[7] = 0.0  # a dead channel: nothing to divide
    s = torch.rand(96, generator=g) * 3 + 0.2
    original = norm.clone()

    applied = _fold_into_norm(norm, s)

    assert torch.equal(norm, norm.to(DENSE_DTYPE).float())
    torch.testing.assert_close(norm * applied, original, rtol=1e-6, atol=0)
    # the rounding moved the scales off s, by at most bf16's half step
    assert not torch.equal(applied, s)
    torch.testing.assert_close(applied, s, rtol=2**-8, atol=0)
    assert applied[7] == s[7]


def test_an_awq_recipe_loads_within_the_bar(tmp_path):
    recipe = {"weights": "w4a16-g128", "kv_cache_dtype": "bf16", "awq": True}
    out = tmp_path / "awq"
    compress(DEMO_MODEL, recipe, out, calibration_size=TEST_CALIBRATION)
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(3))

    with torch.no_grad():
        ref = load_model(DEMO_MODEL).forward_dense(tokens).log_softmax(-1)
        cand = load_model(out).forward_dense(tokens).log_softmax(-1)
    kld = (ref.exp() * (ref - cand)).sum(-1).mean().item()
    assert kld <= 0.03, kld


@pytest.mark.parametrize("weights", ["bf16", "fp16"])
def test_awq_on_dense_weights_is_refused(weights):
    with pytest.raises(RecipeError, match="awq"):
        weight_scheme({"weights": weights, "kv_cache_dtype": "bf16", "awq": True})
