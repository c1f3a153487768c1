import pytest
import torch

from gpuagent.compress import pipeline
from gpuagent.compress.calibration import run_layer
from gpuagent.compress.gptq import (
    HessianAccumulator,
    quantize_gptq,
    quantize_gptq_batch,
)
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


def _experts(num=5, n=24, k=128, seed=1):
    """Random experts [E, N, K] and their input Hessians [E, K, K] from different
    token counts; expert 2 never sees input channel 7 (a zero Hessian column)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(num, n, k, generator=g) * 0.05
    hessians = []
    for e in range(num):
        mix = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
        x = torch.randn(40 + 30 * e, k, generator=g) @ mix
        x[:, e % 4] *= 8  # a loud channel, another per expert
        if e == 2:
            x[:, 7] = 0
        acc = HessianAccumulator(k)
        acc.add(x)
        hessians.append(acc.hessian)
    return weights, hessians


@pytest.mark.parametrize(
    "options",
    [
        {"weights": "w4a16-g32"},
        {"weights": "w4a16-g32", "symmetric": False},
        {"weights": "w4a16-g64", "act_order": True},
        {"weights": "w4a16-g32", "act_order": True, "symmetric": False},
        {"weights": "w4a16-g32", "observer": "mse", "act_order": True},
        {"weights": "w8a16"},
        {"weights": "fp8", "act_order": True},
    ],
)
def test_a_batch_of_experts_gets_each_experts_own_codes(options):
    # one batched call (gate and up sharing each expert's Hessian) against the
    # per-expert call: the same codes, scales and zero points, to the bit
    gate, hessians = _experts()
    up = gate.flip(1) * 1.5
    scheme = weight_scheme({"kv_cache_dtype": "bf16", "method": "gptq", **options})
    assert torch.diag(hessians[2])[7] == 0
    kept = [h.clone() for h in hessians]

    batched = quantize_gptq_batch([gate, up], torch.stack(hessians), scheme)

    for j, w in enumerate((gate, up)):
        assert len(batched[j]) == len(hessians)
        for e, h in enumerate(hessians):
            alone = quantize_gptq(w[e], h, scheme)
            got = batched[j][e]
            assert torch.equal(got.codes.float(), alone.codes.float()), (j, e)
            assert torch.equal(got.scale, alone.scale), (j, e)
            if alone.zero_point is None:
                assert got.zero_point is None
            else:
                assert torch.equal(got.zero_point, alone.zero_point), (j, e)
            assert got.group_size == alone.group_size and got.bits == alone.bits
            # each tensor its own and contiguous, as safetensors writes them
            for t in (got.codes, got.scale, alone.codes, alone.scale):
                assert t.is_contiguous() and t.untyped_storage().nbytes() == (
                    t.numel() * t.element_size()
                )
    # the dead input's column is quantized from a zero weight
    assert (batched[0][2].dequantize()[:, 7] == 0).all()
    # the per-expert call leaves its Hessian as it was
    assert all(torch.equal(h, k) for h, k in zip(hessians, kept, strict=True))


def test_act_order_takes_each_experts_own_column_order():
    # expert e's loudest input is channel e: a batch that took one expert's
    # order for all would round the others' columns in a different order
    weights, hessians = _experts(num=4)
    scheme = weight_scheme(
        {"weights": "w4a16-g32", "kv_cache_dtype": "bf16", "method": "gptq"}
        | {"act_order": True}
    )
    orders = [torch.argsort(torch.diag(h), descending=True) for h in hessians]
    assert len({tuple(o[:4].tolist()) for o in orders}) == 4

    batched = quantize_gptq_batch([weights], torch.stack(hessians), scheme)[0]
    shared = quantize_gptq_batch([weights], torch.stack([hessians[0]] * 4), scheme)[0]

    for e in range(1, 4):
        alone = quantize_gptq(weights[e], hessians[e], scheme)
        assert torch.equal(batched[e].codes, alone.codes)
        assert not torch.equal(shared[e].codes, alone.codes)


def test_it_refuses_hessians_that_are_not_a_float64_stack():
    weights, hessians = _experts(num=2)
    scheme = weight_scheme(
        {"weights": "w8a16", "kv_cache_dtype": "bf16", "method": "gptq"}
    )
    with pytest.raises(ValueError, match=r"float64 \[E, K, K\], got torch.float32"):
        quantize_gptq_batch([weights], torch.stack(hessians).float(), scheme)
