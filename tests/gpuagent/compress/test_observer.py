"""The "mse" observer: each int group's range shrunk to where rounding errs least."""

import pytest
import torch

from gpuagent.compress.gptq import HessianAccumulator, quantize_gptq
from gpuagent.compress.quantize import group_params, quantize_rtn, quantize_values
from gpuagent.compress.recipes import weight_scheme
from tests.gpuagent.compress.test_gptq import _layer, _output_error


def _error(w, scale, zero_point, bits, symmetric, importance=None):
    q = quantize_values(w, scale, zero_point, bits, symmetric)
    error = (w - (q - (0 if zero_point is None else zero_point)) * scale) ** 2
    return (error if importance is None else error * importance).sum(-1)


@pytest.mark.parametrize(("bits", "symmetric"), [(8, True), (4, True), (4, False)])
def test_it_clips_gaussian_rows_and_rounds_them_closer(bits, symmetric):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))

    minmax = group_params(w, bits, symmetric)
    mse = group_params(w, bits, symmetric, "mse")

    minmax_error = _error(w, *minmax, bits, symmetric)
    mse_error = _error(w, *mse, bits, symmetric)
    assert (mse_error <= minmax_error).all()
    assert mse_error.sum() < 0.97 * minmax_error.sum()
    # it got there by shrinking the range, never by widening it
    assert (mse[0] <= minmax[0]).all() and (mse[0] < minmax[0]).any()


def test_an_important_largest_weight_is_never_clipped():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    absmax, at_max = w.abs().max(-1, keepdim=True)
    importance = torch.ones_like(w).scatter_(-1, at_max, 1e6)

    scale, _ = group_params(w, 8, True, "mse", importance)
    unweighted, _ = group_params(w, 8, True, "mse")

    # clipping the channel that matters most would cost more than it saves: the
    # largest weight stays within half a step of a code (|code| <= 127)
    assert (absmax / scale <= 127.5).all()
    assert (absmax / unweighted > 128).any()


@pytest.mark.parametrize(
    "options",
    [
        {"weights": "w4a16-g32"},
        {"weights": "w4a16-g32", "symmetric": False},
        {"weights": "w4a16-g64", "act_order": True},
    ],
)
def test_gptq_with_it_leaves_less_output_error_at_4_bits(options):
    w, x = _layer()
    hessian = HessianAccumulator(128)
    hessian.add(x)
    base = {"kv_cache_dtype": "bf16", "method": "gptq", **options}
    minmax = weight_scheme(base)
    mse = weight_scheme({**base, "observer": "mse"})

    minmax_error = _output_error(w, x, quantize_gptq(w, hessian.hessian, minmax))
    mse_error = _output_error(w, x, quantize_gptq(w, hessian.hessian, mse))

    assert mse_error < minmax_error, (mse_error, minmax_error)


def test_rtn_with_it_rounds_each_weight_closer():
    w, _ = _layer()
    for weights in ("w8a16", "w4a16-g32"):
        recipe = {"kv_cache_dtype": "bf16", "weights": weights}
        minmax = quantize_rtn(w, weight_scheme(recipe)).dequantize()
        mse = quantize_rtn(w, weight_scheme({**recipe, "observer": "mse"}))
        assert ((mse.dequantize() - w) ** 2).sum() < ((minmax - w) ** 2).sum()
