"""The bench's sections on small slices: memory and capacity rows against the cache
accounting (demo-shaped and tiny configs), quality rows on the demo model over short
texts, the attention-output measurement (a diagnostic on real activations, issue 3's
old bar shown but not judged) on one prompt at a few positions, and the exit status
(judged rows only)."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F

import kernels
from gpuagent.benches import engine as bench
from gpuagent.engine.cache import (
    KVCacheManager,
    kv_bytes_per_token,
    kv_static_bytes,
    kv_window_bytes,
)
from gpuagent.engine.engine import DEFAULT_MAX_NUM_SEQS, default_kv_window
from gpuagent.evaluate.evalsets import load_text_slices

PROMPT_TOKENS = 40
POSITIONS = 5
QUANTIZED = ("fp8-per-token", "int8", "int4")


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
    take beyond 1 (fp8's per-head scales are there whatever the size)."""
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
    # 0.2744 vs 0.5312, 0.2900 at d = 32). fp8 has no per-token scales.
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
        if dtype != "fp8":
            assert row.ok is (config.head_dim == 64), row.render()


# --------------------------------------------------------------------- capacity


def expected_admitted(config, dtype: str, budget: int) -> int:
    """2k-token sequences a `budget`-byte cache holds, from the block arithmetic:
    window rows (one per max_num_seqs) first, then whole 16-token blocks, each
    prompt of CAPACITY_SEQ_TOKENS - 1 tokens taking ceil(len / 16) of them."""
    window = default_kv_window(dtype)
    rows_bytes = DEFAULT_MAX_NUM_SEQS * measured_window_bytes(config, dtype, window)
    block_bytes = 16 * measured_bytes_per_token(config, dtype)
    static_bytes = kv_static_bytes(config, dtype)  # fp8's per-head scales
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
    targets = {"fp8-per-token": 1.9, "int8": 1.9, "int4": 3.6}
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


QUALITY_TOKENS = 40


@pytest.fixture(scope="module")
def demo_quality(demo_model_and_tokenizer):
    """int8, int4 and bf16 KV vs bf16 KV on the first passage of every slice."""
    model, _ = demo_model_and_tokenizer
    dtypes = ("int8", "int4", "bf16")
    return bench.kv_quality(
        bench.DEMO_MODEL_DIR, model, dtypes, max_items=1, passage_tokens=QUALITY_TOKENS
    )


def test_kv_quality_scores_each_slice_and_overall(demo_quality):
    int8, int4, bf16 = demo_quality

    for result in demo_quality:
        names = [q.name for q in result.slices]
        assert names == ["english", "code", "korean", "overall"]
        assert [q.num_tokens for q in result.slices[:3]] == [QUALITY_TOKENS - 1] * 3
        assert result.overall.num_tokens == 3 * (QUALITY_TOKENS - 1)
    assert bf16.overall.mean_kld == 0 and bf16.overall.same_top1 == 1.0
    assert 0 < int8.overall.mean_kld < int4.overall.mean_kld
    assert int4.bytes_ratio < int8.bytes_ratio < bf16.bytes_ratio == 1.0


def test_kv_quality_kld_is_kl_of_bf16_kv_to_the_other_dtype(
    demo_model_and_tokenizer, demo_quality
):
    model, tokenizer = demo_model_and_tokenizer
    sequences = [
        tokenizer.encode_prompt(s.passages[0])[:QUALITY_TOKENS]
        for s in load_text_slices()
    ]
    # the engine's in-process scoring prefills a lone prompt in 512-token chunks
    ref = torch.cat(
        [bench.teacher_forced_logprobs(model, s, "bf16", 512) for s in sequences]
    )
    cand = torch.cat(
        [bench.teacher_forced_logprobs(model, s, "int8", 512) for s in sequences]
    )

    # KL(P || Q) = sum P (log P - log Q), P the bf16-KV distribution
    expected = F.kl_div(cand, ref, log_target=True, reduction="batchmean").item()
    assert demo_quality[0].overall.mean_kld == pytest.approx(expected, abs=1e-6)
    same = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
    assert demo_quality[0].overall.same_top1 == pytest.approx(same, abs=1e-6)


def test_the_quality_table_and_rows_judge_each_dtype_by_its_target(demo_quality):
    lines = bench.quality_table(demo_quality)
    rows = bench.quality_rows(demo_quality)

    assert len(lines) == 1 + 3 * 4  # header, 3 dtypes x (3 slices + overall)
    for line, (result, quality) in zip(
        lines[1:],
        [(r, q) for r in demo_quality for q in r.slices],
        strict=True,
    ):
        assert line.split()[:2] == [bench.served(result.dtype), quality.name]
        ok = bench.quality_verdict(result.dtype, quality)
        assert line.endswith("-" if ok is None else ("PASS" if ok else "FAIL"))
        assert f"{result.bytes_ratio:.4f}" in line
    assert_verdicts_match_targets(rows)
    assert [r.ok for r in rows[-2:]] == [None, None]  # bf16 has no target


def test_amortized_bytes_ratio_spreads_the_window_over_2k_tokens(config):
    bf16 = kv_bytes_per_token(config, "bf16")
    for dtype in bench.KV_DTYPES:
        window = default_kv_window(dtype)
        expected = (
            kv_bytes_per_token(config, dtype)
            + (kv_window_bytes(config, window) + kv_static_bytes(config, dtype)) / 2048
        ) / bf16
        assert bench.amortized_bytes_ratio(config, dtype) == pytest.approx(expected)


def test_int4s_window_makes_texts_it_covers_exactly_bf16(demo_model_and_tokenizer):
    # Texts of window + 1 tokens: the last position predicts nothing, every other
    # attends only to tokens still in the bf16 window, whose only difference from
    # bf16 KV is the rotated basis (bf16 rounding of x @ R instead of x).
    model, _ = demo_model_and_tokenizer
    window = default_kv_window("int4")
    assert window > 0

    int4, int8 = bench.kv_quality(
        bench.DEMO_MODEL_DIR, model, ("int4", "int8"), 1, window + 1
    )

    assert int4.overall.mean_kld < 1e-4 and int4.overall.same_top1 == 1.0
    assert int8.overall.mean_kld > 0


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
        model, [ids], ("bf16", "int8", "int4", "fp8-per-token"), POSITIONS, window=0
    )

    num_layers = len(model.layers)
    for dtype, per_layer in errors.items():
        assert per_layer.shape == (num_layers,), dtype
        assert torch.isfinite(per_layer).all(), dtype
    assert (errors["bf16"] == 0).all()
    for dtype in ("int8", "int4", "fp8-per-token"):
        assert (errors[dtype] > 0).all(), dtype
    # int4 has 16 levels per scale against int8's 255: coarser in every layer.
    assert (errors["int8"] < errors["int4"]).all()


def test_int4s_window_lowers_the_error_in_every_layer_and_covers_it_as_bf16(
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
    # Every position in the bf16 window: only bf16 rounding in the rotated basis
    # (x @ R instead of x) differs from the bf16 reference ...
    assert (whole < 0.005).all()
    # ... which is exactly bf16 KV in the rotated basis
    acts = bench.capture_attention_inputs(model, ids)[0]
    picks = bench.sampled_positions(len(ids), POSITIONS)
    rotated_bf16 = bench.decode_attention_outputs(acts, "bf16", picks, rotate=True)
    int4 = bench.decode_attention_outputs(acts, "int4", picks, window=len(ids))
    assert torch.equal(int4, rotated_bf16)


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


def test_attention_rows_are_information_with_the_old_bar_as_text(
    demo_model_and_tokenizer,
):
    model, tokenizer = demo_model_and_tokenizer
    # 50% in every layer: far above issue 3's old bar for every dtype
    errors = {
        dtype: torch.full((len(model.layers),), 0.5, dtype=torch.float64)
        for dtype in ("fp32", *bench.KV_DTYPES[1:])
    }

    items = bench.attention_error_rows(
        model, tokenizer, PROMPT_TOKENS, POSITIONS, errors
    )

    rows = [item for item in items if isinstance(item, bench.Row)]
    assert len(rows) == 1 + 2 * len(bench.KV_DTYPES[1:])
    assert all(row.ok is None and row.target == "" for row in rows)
    mean = the_row(rows, f"attn out {bench.served('int4')} vs bf16 KV: rel. err, mean")
    assert mean.value == "50.000%"
    (text,) = [item for item in items if isinstance(item, str)]
    assert "not judged" in text
    assert f"{bench.served('int4')} <= 5%" in text


@pytest.mark.parametrize("int4_target", [(0.03, 0.92), (0.0, 1.0)])
def test_the_exit_status_counts_the_judged_rows_only(int4_target, monkeypatch, capsys):
    # On the demo model fp8's attention error is above issue 3's old 1% bar (a
    # diagnostic since issue 12) while every KLD/top-1 target passes; an int4
    # target no layout can meet must still fail the run.
    monkeypatch.setitem(bench.QUALITY_TARGETS, "int4", int4_target)

    status = bench.main(["--quality-only", "--quick"])

    out = capsys.readouterr().out
    assert f"attn out {bench.served('fp8')} vs bf16 KV" in out
    assert all(line.endswith("info") for line in out.splitlines() if "attn out" in line)
    if int4_target == (0.0, 1.0):
        assert status == 1 and "FAIL" in out
    else:
        assert status == 0 and "FAIL" not in out


# ------------------------------------------------------------------- serving


def test_mixed_lengths_cycle_through_quarters_of_the_longest():
    assert bench.mixed_lengths(6, 16) == [4, 8, 12, 16, 4, 8]
    assert bench.mixed_lengths(4, 2) == [1, 1, 1, 2]


def test_serving_rows_compare_the_engine_with_transformers_on_useful_tokens(
    tiny_model_dir, tiny_model_and_tokenizer
):
    model, tokenizer = tiny_model_and_tokenizer

    rows = bench.serving_rows(tiny_model_dir, model, tokenizer, "cpu", 4, repeats=1)

    names = [r.name for r in rows]
    assert names[0].startswith("engine tok/s, batch 1")
    # equal lengths first, then mixed
    assert names[1].startswith("engine tok/s, 16 concurrent, equal lengths 4")
    assert names[2].startswith("engine tok/s, 16 concurrent, mixed lengths 1-4")
    equal = the_row(rows, "engine / transformers, 16 concurrent equal lengths")
    assert equal.target == ">= 1.2x"
    engine = number(the_row(rows, "engine tok/s, 16 concurrent, equal").value)
    hf = number(the_row(rows, "transformers tok/s, 16 equal lengths").value)
    assert number(equal.value) == pytest.approx(engine / hf, rel=0.02)
    assert names.index(equal.name) < names.index(
        "engine / transformers, 16 concurrent mixed lengths"
    )
    ratio = the_row(rows, "engine / transformers, 16 concurrent mixed")
    engine = number(the_row(rows, "engine tok/s, 16 concurrent, mixed").value)
    hf = number(the_row(rows, "transformers tok/s, 16 padded").value)
    assert number(ratio.value) == pytest.approx(engine / hf, rel=0.02)
    assert_verdicts_match_targets(rows)


def test_head_rows_time_each_head_copy_and_print_its_quality_cost():
    rows = bench.head_rows(bench.DEMO_MODEL_DIR, "cpu", 4, repeats=1, max_len=32)

    names = [r.name for r in rows]
    assert names[0] == "decode ms/step, batch 1, checkpoint head"
    for fmt in ("int4", "bf16"):
        speed = the_row(rows, f"decode ms/step, batch 1, {fmt} head")
        ms, ratio = speed.value.split()
        assert number(ratio) == pytest.approx(
            float(ms) / float(rows[0].value), rel=0.05
        )
        kld = float(the_row(rows, f"{fmt} head: mean KLD").value)
        top1 = number(the_row(rows, f"{fmt} head: same top-1").value)
        assert 0 < kld < 0.1 and 50 <= top1 <= 100
