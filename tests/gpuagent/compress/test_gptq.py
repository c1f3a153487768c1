import pytest
import torch

from gpuagent.compress import pipeline
from gpuagent.compress.calibration import run_layer
from gpuagent.compress.gptq import HessianAccumulator, quantize_gptq
from gpuagent.compress.quantize import quantize_rtn
from gpuagent.compress.recipes import weight_scheme
from tests.gpuagent.compress.conftest import demo_layer_inputs


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
        {"weights": "fp8"},
        {"weights": "fp8", "act_order": True},
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


def test_fp8_gptq_stores_e4m3_values_on_the_rtn_scales():
    w, x = _layer()
    hessian = HessianAccumulator(128)
    hessian.add(x)
    scheme = weight_scheme({"kv_cache_dtype": "bf16", "weights": "fp8"})
    gptq = weight_scheme({"kv_cache_dtype": "bf16", "weights": "fp8", "method": "gptq"})

    rtn_qw, gptq_qw = quantize_rtn(w, scheme), quantize_gptq(w, hessian.hessian, gptq)

    assert gptq_qw.codes.dtype == torch.float8_e4m3fn
    assert gptq_qw.codes.shape == w.shape and gptq_qw.group_size is None
    assert torch.equal(gptq_qw.scale, rtn_qw.scale)  # per row, absmax / 448
    # GPTQ moves values to other e4m3 neighbours than nearest rounding picks
    assert not torch.equal(gptq_qw.codes.float(), rtn_qw.codes.float())


def test_it_accumulates_the_hessian_of_all_rows():
    _, x = _layer()
    hessian = HessianAccumulator(128)
    for chunk in x.split(300):
        hessian.add(chunk)

    expected = 2 * x.double().t() @ x.double() / x.shape[0]
    torch.testing.assert_close(hessian.hessian, expected)


def _group_hessians(layer, calibration):
    """The input Hessian of each projection group of `layer` as it is now."""
    accumulators = {
        group[0]: HessianAccumulator(layer.get_submodule(group[0]).in_features)
        for group in pipeline._INPUT_GROUPS
    }
    run_layer(layer, *calibration, {p: a.add for p, a in accumulators.items()})
    return {p: a.hessian for p, a in accumulators.items()}


def test_each_group_is_solved_on_the_inputs_of_the_quantized_groups_before_it(
    monkeypatch,
):
    layer, *calibration = demo_layer_inputs(seed=5)
    dense = _group_hessians(layer, calibration)
    used = {}

    def spy(weight, hessian, scheme):
        used[len(used)] = hessian
        return quantize_gptq(weight, hessian, scheme)

    monkeypatch.setattr(pipeline, "quantize_gptq", spy)
    scheme = weight_scheme(
        {"weights": "w4a16-g32", "kv_cache_dtype": "bf16", "method": "gptq"}
    )
    pipeline._quantize_layer(1, layer, scheme, {}, calibration)

    # calls in layer order: q k v (one Hessian), o, gate up (one), down
    solved = {"self_attn.q_proj": used[0], "self_attn.o_proj": used[3]}
    solved |= {"mlp.gate_proj": used[4], "mlp.down_proj": used[6]}
    # a group's input depends only on the groups before it, so the quantized
    # layer's inputs are the ones each group was solved on
    after = _group_hessians(layer, calibration)
    for name, hessian in solved.items():
        torch.testing.assert_close(hessian, after[name], msg=name)
    torch.testing.assert_close(used[0], dense["self_attn.q_proj"])
    for later in ("self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        assert not torch.allclose(solved[later], dense[later]), later
