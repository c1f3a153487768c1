"""The bench's attention-output measurement (issue 3's KV quality bar on real
activations), on a tiny slice: the demo model, one prompt, a few positions."""

from __future__ import annotations

import pytest
import torch

import kernels
from gpuagent.engine import bench

PROMPT_TOKENS = 40
POSITIONS = 5


@pytest.fixture(scope="module")
def demo_model_and_ids():
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    model = load_model(bench.DEMO_MODEL_DIR)
    tokenizer = load_tokenizer(bench.DEMO_MODEL_DIR)
    ids = bench.quality_sequences(tokenizer, PROMPT_TOKENS)[1]  # the code prompt
    return model, ids


def test_it_measures_zero_error_for_the_reference_dtype_and_orders_int8_below_int4(
    demo_model_and_ids,
):
    model, ids = demo_model_and_ids

    errors = bench.attention_relative_errors(
        model, [ids], ("bf16", "int8", "int4", "fp8"), POSITIONS, window=0
    )

    num_layers = len(model.layers)
    for dtype, per_layer in errors.items():
        assert per_layer.shape == (num_layers,), dtype
        assert torch.isfinite(per_layer).all(), dtype
    assert (errors["bf16"] == 0).all()
    for dtype in ("int8", "int4", "fp8"):
        assert (errors[dtype] > 0).all(), dtype
    # int4 has 16 levels per scale against int8's 255: coarser in every layer.
    assert (errors["int8"] < errors["int4"]).all()


def test_int4s_window_lowers_the_error_in_every_layer_and_covers_it_exactly(
    demo_model_and_ids,
):
    model, ids = demo_model_and_ids

    def int4_errors(window):
        errors = bench.attention_relative_errors(
            model, [ids], ("int4",), POSITIONS, window=window
        )
        return errors["int4"]

    bare, served, whole = int4_errors(0), int4_errors(None), int4_errors(len(ids))

    assert (served < bare).all()
    # Every position in the bf16 window: exactly the bf16 reference.
    assert (whole == 0).all()


def test_it_runs_the_production_write_and_decode_kernels(
    demo_model_and_ids, monkeypatch
):
    model, ids = demo_model_and_ids
    # op name -> position of its `cache` argument
    cache_arg = {"write_kv": 0, "paged_decode_attention": 1}
    calls = {name: [] for name in cache_arg}
    for name, index in cache_arg.items():
        original = getattr(kernels, name)

        def counting(*args, _original=original, _name=name, _index=index, **kwargs):
            calls[_name].append(args[_index].dtype)
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counting)
    dtypes = ("int8", "int4")

    bench.attention_relative_errors(model, [ids], dtypes, POSITIONS)

    # per layer: one bf16 reference run and one run per dtype, each writing its own
    # cache and decoding from it; int4's window rows take a second write
    expected = sorted(["bf16", *dtypes] * len(model.layers))
    assert sorted(calls["paged_decode_attention"]) == expected
    assert sorted(calls["write_kv"]) == sorted(expected + ["int4"] * len(model.layers))


def test_it_captures_the_queries_keys_and_values_the_model_attends_with(
    demo_model_and_ids,
):
    # Decode attention over the captured q/k/v in an fp32 cache must reproduce the
    # model's own attention output at those positions, taken from the dense path
    # (SDPA, no cache) at o_proj's input.
    model, ids = demo_model_and_ids
    # as in the bench, where the engine has prepacked (and fused) the projections
    model.prepack_cpu_weights()
    o_proj_inputs = []
    handles = [
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda _module, args: o_proj_inputs.append(args[0][0])  # [T, H * D]
        )
        for layer in model.layers
    ]
    try:
        with torch.inference_mode():
            model.forward_dense(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    picks = torch.tensor([0, 7, len(ids) - 1])

    layers = bench.capture_attention_inputs(model, ids)

    assert len(layers) == len(model.layers)
    for acts, dense in zip(layers, o_proj_inputs, strict=True):
        out = bench.decode_attention_outputs(acts, "fp32", picks)  # [P, H, D]
        torch.testing.assert_close(out.flatten(-2), dense[picks], rtol=1e-4, atol=1e-5)
