import pytest
import torch

from gpuagent.compress.gptq import HessianAccumulator, quantize_gptq
from gpuagent.compress.quantize import quantize_rtn
from gpuagent.compress.recipes import weight_scheme


def _layer():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * 0.05
    # correlated inputs with a few loud channels, as activations have
    mix = torch.randn(128, 128, generator=g) * 0.3 + torch.eye(128)
    x = torch.randn(2048, 128, generator=g) @ mix
    x[:, :4] *= 8
    return w, x


def _output_error(w, x, qw):
    return ((x @ w.t() - x @ qw.dequantize().t()) ** 2).mean().item()


@pytest.mark.parametrize(
    "options",
    [
        {"weights": "w4a16-g32"},
        {"weights": "w4a16-g32", "symmetric": False},
        {"weights": "w4a16-g64", "act_order": True},
        {"weights": "w8a16"},
    ],
)
def test_it_beats_round_to_nearest_on_the_layer_output(options):
    w, x = _layer()
    hessian = HessianAccumulator(128)
    for chunk in x.split(500):
        hessian.add(chunk)
    rtn_options = {k: v for k, v in options.items() if k != "act_order"}
    rtn = weight_scheme({"kv_cache_dtype": "bf16", **rtn_options})
    gptq = weight_scheme({"kv_cache_dtype": "bf16", "method": "gptq", **options})

    rtn_error = _output_error(w, x, quantize_rtn(w, rtn))
    gptq_error = _output_error(w, x, quantize_gptq(w, hessian.hessian, gptq))

    assert gptq_error < 0.8 * rtn_error, (gptq_error, rtn_error)


def test_it_accumulates_the_hessian_of_all_rows():
    _, x = _layer()
    hessian = HessianAccumulator(128)
    for chunk in x.split(300):
        hessian.add(chunk)

    expected = 2 * x.double().t() @ x.double() / x.shape[0]
    torch.testing.assert_close(hessian.hessian, expected)
