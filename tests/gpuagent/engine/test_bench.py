"""The bench's sections on small slices: memory and capacity rows against the cache
accounting (demo-shaped and tiny configs), quality rows on the demo model over short
texts, and the attention-output measurement (issue 3's KV quality bar on real
activations) on one prompt at a few positions."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F

import kernels
from gpuagent.engine import bench
from gpuagent.engine.cache import (
    KVCacheManager,
    kv_bytes_per_token,
    kv_static_bytes,
    kv_window_bytes,
)
from gpuagent.engine.engine import DEFAULT_MAX_NUM_SEQS, default_kv_window

PROMPT_TOKENS = 40
POSITIONS = 5
QUANTIZED = ("fp8", "int8", "int4")


@pytest.fixture(scope="module")
def demo_model_and_tokenizer():
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    return load_model(bench.DEMO_MODEL_DIR), load_tokenizer(bench.DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def demo_model_and_ids(demo_model_and_tokenizer):
    model, tokenizer = demo_model_and_tokenizer
    ids = bench.quality_sequences(tokenizer, PROMPT_TOKENS)[1]  # the code prompt
    return model, ids


@pytest.fixture(params=["demo", "tiny"])
def config(request, demo_model_and_tokenizer, tiny_model_and_tokenizer):
    """The demo model's config (head_dim 64), or conftest's tiny one (head_dim 32,
    where the per-token scales take a larger share and the memory targets fail)."""
    if request.param == "demo":
        return demo_model_and_tokenizer[0].config
    return tiny_model_and_tokenizer[0].config


# ---------------------------------------------------------------------- helpers


def measured_bytes_per_token(config, dtype: str) -> float:
    """Bytes per token slot of really allocated caches (all layers): what 2 blocks
    take beyond 1 (fp8-static's per-head scales are there whatever the size)."""
    one = KVCacheManager(config, dtype, num_blocks=1, block_size=16).nbytes
    two = KVCacheManager(config, dtype, num_blocks=2, block_size=16).nbytes
    return (two - one) / 16


def measured_window_bytes(config, dtype: str, window: int) -> int:
    """Bytes one window row adds to a really allocated cache (all layers)."""
    if window == 0:
        return 0
    bare = KVCacheManager(config, dtype, num_blocks=1, block_size=16)
    windowed = KVCacheManager(
        config, dtype, num_blocks=1, block_size=16, window=window, num_windows=1
    )
    return windowed.nbytes - bare.nbytes


def number(text: str) -> float:
    """A Row's value or target as a number: '0.5156', '1.938x', '98.29%', '>= 1.9x'."""
    return float(text.lstrip("<>= ").rstrip("x%"))


def verdict(row: bench.Row) -> bool:
    """What the row's printed value says against its printed target."""
    compare = {"<=": operator.le, ">=": operator.ge}[row.target.split()[0]]
    return compare(number(row.value), number(row.target))


def the_row(rows: list[bench.Row], starts: str) -> bench.Row:
    (row,) = [r for r in rows if r.name.startswith(starts)]
    return row


def assert_verdicts_match_targets(rows: list[bench.Row]) -> None:
    for row in rows:
        if row.target:
            assert row.ok is verdict(row), row.render()
        else:
            assert row.ok is None, row.render()


# ----------------------------------------------------------------------- memory


def test_memory_rows_are_the_exact_cache_accounting(config):
    rows = bench.memory_rows(config)

    bf16 = kv_bytes_per_token(config, "bf16")
    assert bf16 == measured_bytes_per_token(config, "bf16")
    assert rows[0].value == str(bf16)
    for dtype in bench.KV_DTYPES[1:]:
        per_token = kv_bytes_per_token(config, dtype)
        assert per_token == measured_bytes_per_token(config, dtype), dtype
        row = the_row(rows, f"KV bytes/token {dtype} / bf16")
        assert f"({per_token} B)" in row.name
        assert row.value == f"{per_token / bf16:.4f}"
    window = default_kv_window("int4")
    window_row = the_row(rows, "  int4 full-precision window")
    assert int(window_row.value) == kv_window_bytes(config, window)
    assert int(window_row.value) == measured_window_bytes(config, "int4", window)
    assert_verdicts_match_targets(rows)


def test_memory_targets_pass_at_head_dim_64_and_fail_at_32(config):
    # One fp16 scale per head per token for K and V: (d + 2) / 2d of bf16 for
    # fp8/int8, (d/2 + 2) / 2d for int4, which also holds an 18-token window row per
    # 2k-token sequence; the targets (0.52, 0.28) hold for d = 64 only (0.5156,
    # 0.2744 vs 0.5312, 0.2900 at d = 32). fp8-static has no per-token scales.
    rows = bench.memory_rows(config)
    bf16 = kv_bytes_per_token(config, "bf16")

    for dtype, target in bench.MEMORY_TARGETS.items():
        window = default_kv_window(dtype)
        exact = kv_bytes_per_token(config, dtype) / bf16
        row = the_row(rows, f"KV bytes/token {dtype} / bf16")
        if window:
            assert row.ok is None
            exact += kv_window_bytes(config, window) / bench.CAPACITY_SEQ_TOKENS / bf16
            row = the_row(rows, f"  {bench.served(dtype)} / bf16, window spread")
        assert row.ok is (exact <= target), row.render()
        if dtype != "fp8-static":
            assert row.ok is (config.head_dim == 64), row.render()


# --------------------------------------------------------------------- capacity


def expected_admitted(config, dtype: str, budget: int) -> int:
    """2k-token sequences a `budget`-byte cache holds, from the block arithmetic:
    window rows (one per max_num_seqs) first, then whole 16-token blocks, each
    prompt of CAPACITY_SEQ_TOKENS - 1 tokens taking ceil(len / 16) of them."""
    window = default_kv_window(dtype)
    rows_bytes = DEFAULT_MAX_NUM_SEQS * measured_window_bytes(config, dtype, window)
    block_bytes = 16 * measured_bytes_per_token(config, dtype)
    static_bytes = kv_static_bytes(config, dtype)  # fp8-static's per-head scales
    blocks = int((budget - rows_bytes - static_bytes) // block_bytes)
    blocks_per_seq = math.ceil((bench.CAPACITY_SEQ_TOKENS - 1) / 16)
    return min(blocks // blocks_per_seq, DEFAULT_MAX_NUM_SEQS)


def test_capacity_rows_admit_what_the_block_budget_allows(config):
    budget = (
        bench.CAPACITY_BF16_SEQS
        * bench.CAPACITY_SEQ_TOKENS
        * kv_bytes_per_token(config, "bf16")
    )

    rows = bench.capacity_rows(config)

    assert int(rows[0].value) == bench.CAPACITY_BF16_SEQS
    assert expected_admitted(config, "bf16", budget) == bench.CAPACITY_BF16_SEQS
    for dtype in bench.KV_DTYPES[1:]:
        expected = expected_admitted(config, dtype, budget)
        row = the_row(rows, f"2k-token seqs admitted {bench.served(dtype)} / bf16")
        assert f"({expected})" in row.name, (row.render(), expected)
        assert row.value == f"{expected / bench.CAPACITY_BF16_SEQS:.3f}x"
    assert_verdicts_match_targets(rows)


def test_capacity_targets_pass_on_the_demo_shape_and_fail_on_the_tiny_one(config):
    # demo (d = 64): fp8/int8 31 of 16 (1.94x), int4+w16 58 (3.62x); tiny (d = 32):
    # 30 (1.88x < 1.9x) and 55 (3.44x < 3.6x)
    rows = bench.capacity_rows(config)
    targets = {"fp8": 1.9, "int8": 1.9, "int4": 3.6}
    budget = bench.CAPACITY_BF16_SEQS * bench.CAPACITY_SEQ_TOKENS
    budget *= kv_bytes_per_token(config, "bf16")

    for dtype, target in targets.items():
        ratio = expected_admitted(config, dtype, budget) / bench.CAPACITY_BF16_SEQS
        row = the_row(rows, f"2k-token seqs admitted {bench.served(dtype)} / bf16")
        assert row.ok is (ratio >= target), row.render()
        assert row.ok is (config.head_dim == 64), row.render()


def test_admitted_sequences_really_allocates_within_the_budget(config):
    budget = bench.CAPACITY_SEQ_TOKENS * 20 * kv_bytes_per_token(config, "int4")

    admitted, nbytes = bench.admitted_sequences(config, "int4", budget)

    assert admitted == expected_admitted(config, "int4", budget)
    assert nbytes <= budget
    # the rest of the budget is less than one more block
    assert budget - nbytes < 16 * kv_bytes_per_token(config, "int4")


# ---------------------------------------------------------------------- quality


def test_quality_rows_judge_each_kv_dtype_against_bf16_kv(demo_model_and_tokenizer):
    model, tokenizer = demo_model_and_tokenizer

    rows = bench.quality_rows(model, tokenizer, PROMPT_TOKENS)

    positions = len(bench.QUALITY_TEXTS) * (PROMPT_TOKENS - 1)
    kld = {}
    for dtype in bench.KV_DTYPES[1:]:
        label = f"KV {bench.served(dtype)} vs bf16"
        kld_row = the_row(rows, f"{label}: mean KLD")
        assert f"({positions} positions)" in kld_row.name
        kld[dtype] = number(kld_row.value)
        top1 = number(the_row(rows, f"{label}: same top-1").value)
        assert 0 <= top1 <= 100
    for dtype in ("fp16", *QUANTIZED):
        assert kld[dtype] > 0, dtype  # fp16 keeps 3 more mantissa bits than bf16
    assert kld["int8"] < kld["int4"]
    assert_verdicts_match_targets(rows)
    bits = number(the_row(rows, "bits/token on the quality texts").value)
    assert 0 < bits < 8


def test_quality_kld_is_kl_of_bf16_kv_to_the_other_dtype(demo_model_and_tokenizer):
    model, tokenizer = demo_model_and_tokenizer
    sequences = bench.quality_sequences(tokenizer, PROMPT_TOKENS)

    rows = bench.quality_rows(model, tokenizer, PROMPT_TOKENS)

    ref = torch.cat(
        [bench.teacher_forced_logprobs(model, s, "bf16") for s in sequences]
    )
    cand = torch.cat(
        [bench.teacher_forced_logprobs(model, s, "int8") for s in sequences]
    )
    # KL(P || Q) = sum P (log P - log Q), P the bf16-KV distribution
    expected = F.kl_div(cand, ref, log_target=True, reduction="batchmean").item()
    row = the_row(rows, "KV int8 vs bf16: mean KLD")
    assert number(row.value) == pytest.approx(expected, abs=1e-6)
    same = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
    top1 = the_row(rows, "KV int8 vs bf16: same top-1")
    assert number(top1.value) == pytest.approx(100 * same, abs=0.005)


def test_bf16_kv_against_itself_has_zero_kld_and_the_same_top_1(
    demo_model_and_tokenizer, monkeypatch
):
    model, tokenizer = demo_model_and_tokenizer
    monkeypatch.setattr(bench, "KV_DTYPES", ("bf16", "bf16"))

    rows = bench.quality_rows(model, tokenizer, PROMPT_TOKENS)

    assert number(the_row(rows, "KV bf16 vs bf16: mean KLD").value) == 0
    assert the_row(rows, "KV bf16 vs bf16: same top-1").value == "100.00%"


def test_int4s_window_makes_texts_it_covers_exactly_bf16(demo_model_and_tokenizer):
    # Texts of window + 1 tokens: the last position predicts nothing, every other
    # attends only to tokens still in the bf16 window, whose only difference from
    # bf16 KV is the rotated basis (bf16 rounding of x @ R instead of x).
    model, tokenizer = demo_model_and_tokenizer
    window = default_kv_window("int4")
    assert window > 0

    rows = bench.quality_rows(model, tokenizer, window + 1)

    label = f"KV {bench.served('int4')} vs bf16"
    kld = number(the_row(rows, f"{label}: mean KLD").value)
    assert kld < 1e-4
    assert the_row(rows, f"{label}: same top-1").value == "100.00%"
    assert number(the_row(rows, "KV int8 vs bf16: mean KLD").value) > 0


def test_quality_bits_per_token_match_the_dense_path(demo_model_and_tokenizer):
    model, tokenizer = demo_model_and_tokenizer
    sequences = bench.quality_sequences(tokenizer, PROMPT_TOKENS)
    nll = 0.0
    with torch.inference_mode():
        for ids in sequences:
            logits = model.forward_dense(torch.tensor([ids]))[0, :-1]
            nll += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    dense_bits = nll.item() / (sum(len(s) - 1 for s in sequences) * math.log(2))

    rows = bench.quality_rows(model, tokenizer, PROMPT_TOKENS)

    bits = number(the_row(rows, "bits/token on the quality texts").value)
    # bf16 K/V against the fp32 dense path: close, not equal
    assert bits == pytest.approx(dense_bits, rel=0.01)


def test_a_row_renders_its_verdict():
    assert bench.Row("m", "1", "<= 2", True).render().endswith("PASS")
    assert bench.Row("m", "3", "<= 2", False).render().endswith("FAIL")
    assert bench.Row("m", "3", "", None).render().endswith("info")


# ------------------------------------------------------------ attention output


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
