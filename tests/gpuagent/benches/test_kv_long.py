"""The KV long-text bench: passages scored whole (a short one refused), the tail
past position 512 scored apart, bytes counted at the measured length, verdicts
judged overall and on the tail."""

from __future__ import annotations

import numpy as np
import pytest

from gpuagent.benches import DEMO_MODEL_DIR, kv_long
from gpuagent.benches import engine as engine_bench
from gpuagent.benches import kv_alternatives as alt
from gpuagent.evaluate.evalsets import HeldOutPassage, load_text_slices
from gpuagent.evaluate.metrics import PositionStats
from gpuagent.protocol import SliceQuality


@pytest.fixture(scope="module")
def demo_model():
    from gpuagent.engine.loader import load_model

    return load_model(DEMO_MODEL_DIR)


def passages() -> list[HeldOutPassage]:
    return [HeldOutPassage(s.name, "first", s.passages[0]) for s in load_text_slices()]


def test_bytes_are_counted_at_the_measured_length(demo_model):
    config = demo_model.config

    at_2k = kv_long.measured_bytes_ratio(config, "int4", 18, 2048)
    at_4k = kv_long.measured_bytes_ratio(config, "int4", 18, 4096)

    assert at_2k == pytest.approx(engine_bench.amortized_bytes_ratio(config, "int4"))
    assert at_4k == pytest.approx((68 + 18 * 256 / 4096) / 256)


def test_the_tail_keeps_the_positions_from_its_start():
    stats = PositionStats(np.arange(6.0), np.ones(6, bool), np.zeros(6), np.zeros(6))

    tail = kv_long.tail_stats(stats, 4)

    assert tail.kld.tolist() == [4.0, 5.0]


def test_it_scores_every_position_of_each_passage_uncut(demo_model):
    texts = passages()
    layouts = [alt.BF16]

    stats, lengths = kv_long.score_passages(
        DEMO_MODEL_DIR,
        demo_model,
        ("int4",),
        layouts,
        progress=lambda _: None,
        passages=texts,
        min_tokens=16,
    )
    results = kv_long.long_quality(
        demo_model.config, stats, min(lengths), layouts, tail_from=40
    )

    for dtype in ("int4", alt.BF16.name):
        scored = [
            len(s) for name in ("english", "code", "korean") for s in stats[dtype][name]
        ]
        assert scored == [n - 1 for n in lengths]  # every next token, none cut
    int4, sim_bf16 = results
    assert int4.get("overall").num_tokens == sum(lengths) - len(lengths)
    assert int4.tail.num_tokens == sum(n - 1 - 40 for n in lengths)
    assert sim_bf16.get("overall").mean_kld < 1e-6 < int4.get("overall").mean_kld
    assert int4.bytes_ratio == pytest.approx(
        kv_long.measured_bytes_ratio(demo_model.config, "int4", 18, min(lengths))
    )


def test_layouts_alone_are_scored_and_a_centering_one_gets_the_key_means(
    demo_model,
):
    texts = passages()[:1]
    layouts = [alt.BF16, alt.named_layout("sim-int4gc+w17s1")]

    stats, lengths = kv_long.score_passages(
        DEMO_MODEL_DIR,
        demo_model,
        (),
        layouts,
        progress=lambda _: None,
        passages=texts,
        min_tokens=16,
    )

    assert list(stats) == [x.name for x in layouts]
    (centered,) = stats[layouts[1].name][texts[0].slice]
    assert len(centered) == lengths[0] - 1
    assert 0 < centered.kld.mean() < 1
    (exact,) = stats[alt.BF16.name][texts[0].slice]
    assert exact.kld.mean() < 1e-6


def test_a_passage_under_the_minimum_is_refused_by_name(demo_model):
    with pytest.raises(ValueError, match="english-first is .* under the 100000"):
        kv_long.score_passages(
            DEMO_MODEL_DIR,
            demo_model,
            ("int4",),
            progress=lambda _: None,
            passages=passages()[:1],
            min_tokens=100000,
        )


def quality(name: str, kld: float, top1: float) -> SliceQuality:
    return SliceQuality(
        name=name,
        num_tokens=1,
        mean_kld=kld,
        mean_kld_ci95=None,
        p99_kld=kld,
        max_kld=kld,
        same_top1=top1,
        same_top1_ci95=None,
        ppl_candidate=1.0,
        ppl_reference=1.0,
        ppl_ratio=1.0,
        num_continuations=0,
        exact_match=0.0,
        flips=0,
    )


@pytest.mark.parametrize(
    ("overall", "tail", "ratio", "ok"),
    [
        ((0.009, 0.97), (0.0099, 0.961), 0.27, True),
        ((0.009, 0.97), (0.011, 0.97), 0.27, False),  # the tail misses
        ((0.009, 0.97), (0.009, 0.97), 0.29, False),  # too many bytes
        ((0.009, 0.95), (0.009, 0.97), 0.27, False),
    ],
)
def test_int4_is_judged_overall_on_the_tail_and_on_bytes(overall, tail, ratio, ok):
    slices = [quality("overall", *overall), quality("pos>=512", *tail)]

    assert kv_long.verdict(kv_long.LongQuality("int4", ratio, slices)) is ok


def test_a_simulated_int4_variant_is_judged_against_int4s_bar_and_kivi_is_not():
    slices = [quality("overall", 0.009, 0.97), quality("pos>=512", 0.009, 0.97)]

    sim = kv_long.LongQuality("sim-int4gc+w17s1", 0.2749, slices)
    kivi = kv_long.LongQuality("kivi-g32r32", 0.2749, slices)

    assert kv_long.verdict(sim) is True
    assert kv_long.verdict(kivi) is None
    assert kv_long.table([sim, kivi])[-1] == (
        "sim-int4gc+w17s1 (simulated, int4's bar): mean KLD <= 0.01, top-1 >= 96% "
        "(overall and pos>=512), bytes <= 0.28 of bf16: PASS"
    )


def test_the_engine_bench_judges_each_dtype_overall_on_the_tail_and_on_bytes(
    demo_model, monkeypatch
):
    # the demo model holds 2048 positions: its own short passages stand in
    monkeypatch.setattr(kv_long, "load_heldout_passages", passages)
    monkeypatch.setattr(kv_long, "MIN_TOKENS", 16)
    monkeypatch.setattr(kv_long, "TAIL_FROM", 40)

    rows = engine_bench.long_kv_rows(DEMO_MODEL_DIR, demo_model)

    judged = [r for r in rows if isinstance(r, engine_bench.Row)]
    assert len(judged) == 3 * 5  # fp8, int8, int4: KLD and top-1 twice, bytes
    assert [r.name for r in judged[:5]] == [
        "KV fp8+w16 held-out overall: mean KLD",
        "KV fp8+w16 held-out overall: same top-1",
        "KV fp8+w16 held-out pos>=40: mean KLD",
        "KV fp8+w16 held-out pos>=40: same top-1",
        judged[4].name,
    ]
    assert all(r.ok is not None for r in judged)
    assert judged[-1].target == "<= 0.28"
