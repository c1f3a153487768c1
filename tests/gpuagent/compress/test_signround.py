"""Sign-gradient rounding (gpuagent.compress.signround) on a demo-model layer."""

import copy

import pytest
import torch

from gpuagent.compress.calibration import run_layer
from gpuagent.compress.checkpoint import PROJECTIONS
from gpuagent.compress.quantize import SCALE_DTYPE, quantize_rtn
from gpuagent.compress.recipes import RecipeError, weight_scheme
from gpuagent.compress.signround import _Rounding, tune_layer
from tests.gpuagent.compress.conftest import demo_layer_inputs


def _scheme(weights, **options):
    return weight_scheme(
        {"kv_cache_dtype": "bf16", "weights": weights, "method": "signround", **options}
    )


def _rtn(layer, scheme):
    layer = copy.deepcopy(layer)
    for name in PROJECTIONS:
        module = layer.get_submodule(name)
        with torch.no_grad():
            module.weight.copy_(quantize_rtn(module.weight, scheme).dequantize())
    return layer


def _error(layer, hidden, cos, sin, target):
    return ((run_layer(layer, hidden, cos, sin) - target) ** 2).mean().item()


@pytest.mark.parametrize(
    ("weights", "options"),
    [("w4a16-g32", {}), ("w4a16-g32", {"observer": "mse"}), ("w8a16", {})],
)
def test_it_beats_round_to_nearest_on_the_layer_output(weights, options):
    layer, hidden, cos, sin = demo_layer_inputs(seed=0)
    target = run_layer(layer, hidden, cos, sin)
    scheme = _scheme(weights, **options)
    original = {n: layer.get_submodule(n).weight.detach().clone() for n in PROJECTIONS}
    rtn_error = _error(_rtn(layer, scheme), hidden, cos, sin, target)

    quantized = tune_layer(layer, hidden, target, cos, sin, scheme, steps=60)
    tuned_error = _error(layer, hidden, cos, sin, target)

    assert tuned_error < 0.8 * rtn_error, (tuned_error, rtn_error)
    lo, hi = (-8, 7) if weights.startswith("w4") else (-127, 127)
    for name, qw in quantized.items():
        weight = layer.get_submodule(name).weight
        assert torch.equal(weight, qw.dequantize())  # the layer runs what is stored
        assert qw.scale.dtype == SCALE_DTYPE and qw.zero_point is None
        assert lo <= qw.codes.min() and qw.codes.max() <= hi
        # a code inside the range is w / scale rounded down or up (|v| <= 0.5)
        step = qw.scale.float().repeat_interleave(qw.group_size or weight.shape[1], 1)
        inside = (qw.codes > lo) & (qw.codes < hi)
        off = (qw.codes.float() - original[name] / step).abs()
        assert (off[inside] <= 1 + 1e-4).all() and inside.float().mean() > 0.9
    assert all(p.requires_grad for p in layer.parameters())  # left as found
    assert not hasattr(layer.self_attn.q_proj, "parametrizations")


def _signed_rtn(w, group):
    # round to nearest on AutoRound's full-range signed scales, written out: the
    # larger extreme of each group over 8, signed so that it maps to code -8
    groups = w.view(w.shape[0], -1, group)
    neg = -groups.amin(-1, keepdim=True).clamp(max=0)
    pos = groups.amax(-1, keepdim=True).clamp(min=0)
    scale = torch.where(neg >= pos, neg / 8, -pos / 8).to(SCALE_DTYPE).float()
    codes = (groups / scale).round().clamp(-8, 7)
    return codes, scale


def test_it_keeps_the_lowest_loss_step_so_more_steps_never_lose():
    layer, hidden, cos, sin = demo_layer_inputs(seed=1)
    target = run_layer(layer, hidden, cos, sin)
    scheme = _scheme("w4a16-g32")
    errors, untuned = [], None
    for steps in (0, 40):
        tuned = copy.deepcopy(layer)
        quantized = tune_layer(tuned, hidden, target, cos, sin, scheme, steps=steps)
        errors.append(_error(tuned, hidden, cos, sin, target))
        untuned = untuned or quantized

    # no step: round-to-nearest on the full-range signed scales, exactly
    for name, qw in untuned.items():
        codes, scale = _signed_rtn(layer.get_submodule(name).weight, 32)
        assert torch.equal(qw.codes.view_as(codes).float(), codes), name
        assert torch.equal(qw.scale.float(), scale[..., 0]), name
    assert errors[1] < errors[0]


def test_the_scale_is_signed_so_the_larger_extreme_is_code_minus_8():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g) * 0.05
    w[::2, 5] = 0.4  # the positive extreme dominates in even rows' first group
    w[1::2, 5] = -0.4  # the negative one in odd rows'

    qw = _Rounding(w, _scheme("w4a16-g32")).quantized(w)
    rtn = quantize_rtn(w, _scheme("w4a16-g32"))

    first = qw.scale[:, 0].float()
    assert (first[::2] < 0).all() and (first[1::2] > 0).all()
    assert (qw.codes[:, 5] == -8).all()  # each extreme, exactly, either sign
    torch.testing.assert_close(
        qw.dequantize()[:, 5], w[:, 5], rtol=2**-8, atol=0
    )  # bf16 scale
    # |scale| = extreme / 8 (round-to-nearest's is absmax / 7.5): a 1/16 finer
    # step and no clipped extreme, so less error overall
    torch.testing.assert_close(
        first.abs(), rtn.scale[:, 0].float() * 7.5 / 8, rtol=2**-7, atol=0
    )
    assert ((qw.dequantize() - w) ** 2).sum() < ((rtn.dequantize() - w) ** 2).sum()
    # int8's codes are symmetric ([-127, 127]): positive scales, as round to nearest
    int8 = _Rounding(w, _scheme("w8a16")).quantized(w)
    assert (int8.scale > 0).all()
    assert torch.equal(int8.codes, quantize_rtn(w, _scheme("w8a16")).codes)


@pytest.mark.parametrize(
    ("weights", "options", "named"),
    [
        ("fp8", {}, "not 'fp8'"),
        ("w4a16-g64", {"symmetric": False}, "symmetric=false"),
        ("w4a16-g64", {"act_order": True}, "act_order=true needs method 'gptq'"),
    ],
)
def test_a_recipe_it_cannot_apply_is_refused_by_name(weights, options, named):
    with pytest.raises(RecipeError, match=named):
        _scheme(weights, **options)


def test_the_weight_tuned_is_the_weight_stored():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 128, generator=g) * 0.05
    rounding = _Rounding(w, _scheme("w4a16-g32"))
    with torch.no_grad():
        rounding.v.uniform_(-0.5, 0.5, generator=g)
        rounding.min_shrink.uniform_(0.5, 1.0, generator=g)
        rounding.max_shrink.uniform_(0.5, 1.0, generator=g)

    # the scales are rounded to bf16 in the forward too (straight through)
    assert torch.equal(rounding(w), rounding.quantized(w).dequantize())
