from decimal import Decimal

import pytest

from controlplane.costs.money import Pricing
from controlplane.costs.report import economics
from controlplane.dashboard import charts
from controlplane.releases.gates import GatePolicy
from tests.controlplane.dashboard.builders import load_test_report, quality_report

INT8 = {"weights": "int4-g128", "kv_cache_dtype": "int8"}
BF16 = {"weights": "bf16", "kv_cache_dtype": "bf16"}
PRICED = Pricing("USD", Decimal("2.50"))
UNPRICED = Pricing("USD", Decimal(0))


def test_it_splits_memory_into_weights_and_kv_per_release():
    candidate, live = load_test_report(INT8), load_test_report(BF16)

    figure = charts.memory_figure(
        [("candidate", candidate), ("parent", None), ("live", live)]
    )

    weights, kv = figure["data"]
    assert weights["x"] == ["candidate", "live"]
    assert weights["y"] == [candidate.weights_bytes / 2**30, live.weights_bytes / 2**30]
    assert kv["y"] == [candidate.kv_budget_bytes / 2**30, live.kv_budget_bytes / 2**30]
    assert figure["layout"]["barmode"] == "stack"


def rows_of(report, policy=None, pricing=PRICED):
    return economics(report, policy or GatePolicy(), pricing)


def test_it_draws_nothing_without_reports():
    assert charts.memory_figure([("candidate", None)]) is None
    assert charts.latency_figure({}, "ttft_ms") is None
    assert charts.load_curves_figure("chat", []) is None
    assert charts.context_figure([]) is None
    assert charts.goodput_figure([]) is None
    assert charts.reuse_figure([], PRICED) is None
    assert charts.quality_kld_figure(None) is None
    assert charts.cost_figure([]) is None
    assert charts.timeline_figure([]) is None


def test_it_draws_candidate_and_live_over_concurrency_with_the_knee():
    candidate, live = rows_of(load_test_report(INT8)), rows_of(load_test_report(BF16))

    figure = charts.load_curves_figure(
        "chat", [("candidate 1.0", candidate), ("live 0.9", live)]
    )

    names = [trace["name"] for trace in figure["data"]]
    assert names.count("candidate 1.0") == 3 and names.count("live 0.9") == 3
    throughput = figure["data"][0]
    runs = [r for r in candidate["chat"].workload.runs if r.concurrency is not None]
    assert throughput["x"] == [r.concurrency for r in runs]
    assert throughput["y"] == [r.output_tokens_per_s for r in runs]
    assert "x" in throughput["marker"]["symbol"]  # a level that missed the SLO
    live_line = next(t for t in figure["data"] if t["name"] == "live 0.9")
    assert live_line["line"]["dash"] != throughput["line"]["dash"]
    knee = next(t for t in figure["data"] if t["name"] == "knee (candidate 1.0)")
    assert knee["x"] == [candidate["chat"].knee]
    assert {t["yaxis"] for t in figure["data"] if t["name"] == "live 0.9"} == {
        "y",
        "y2",
        "y3",
    }


def test_it_draws_the_slo_of_the_gate_policy_in_force():
    """The builders' reports say chat's SLO is TPOT p99 60 ms (what the load test
    ran to); the gate judges 100 ms by default and 45 ms under this policy, and
    that is what the charts draw."""
    policy = GatePolicy.model_validate(
        {"load": {"per_workload": {"chat": {"max_tpot_p99_ms": 45}}}}
    )
    rows = rows_of(load_test_report(INT8), policy)

    curves = charts.load_curves_figure("chat", [("candidate", rows)])
    latency = charts.latency_figure(rows, "tpot_ms")

    slo_lines = [t for t in curves["data"] if t["name"] == "SLO (gate policy)"]
    assert {(t["yaxis"], t["y"][0]) for t in slo_lines} == {("y2", 2000), ("y3", 45)}
    markers = latency["data"][-1]
    assert markers["name"] == "SLO p99 (gate policy)"
    assert dict(zip(markers["x"], markers["y"], strict=True)) == {
        "chat": 45,
        "rag": 100,
        "code": 100,
    }


def test_it_shows_latency_at_the_slo_operating_point():
    rows = rows_of(load_test_report(INT8))
    chat = rows["chat"]

    figure = charts.latency_figure(rows, "tpot_ms")

    p99 = next(trace for trace in figure["data"] if trace["name"] == "p99")
    assert p99["y"][0] == chat.operating_point.tpot_ms.p99
    assert chat.operating_point.tpot_ms.p99 <= 100


def test_it_draws_ttft_over_context_length_and_goodput_over_arrival_rate():
    candidate, live = rows_of(load_test_report(INT8)), rows_of(load_test_report(BF16))
    sides = [("candidate", candidate), ("live", live)]

    context = charts.context_figure(sides)
    goodput = charts.goodput_figure(sides)

    sweep = candidate["rag"].workload.context_sweep
    rag = next(t for t in context["data"] if t["name"] == "rag · candidate")
    assert rag["x"] == [r.prompt_tokens for r in sweep]
    assert rag["y"] == [r.ttft_ms.p99 for r in sweep]
    assert any(t["name"] == "rag · live" for t in context["data"])
    chat = next(t for t in goodput["data"] if t["name"] == "chat · live")
    open_loop = [r for r in live["chat"].workload.runs if r.request_rate is not None]
    assert chat["x"] == [r.request_rate for r in open_loop]
    assert chat["y"] == [r.goodput for r in open_loop]


def test_it_prices_each_run_against_its_cache_hit_rate():
    """Chat's runs report hit rates; at 2.50 USD per device-hour a run serving R
    requests/s costs 2.50 / (R x 3600) per request."""
    rows = rows_of(load_test_report(INT8))

    priced = charts.reuse_figure([("candidate", rows)], PRICED)
    unpriced = charts.reuse_figure(
        [("candidate", rows_of(load_test_report(INT8), pricing=UNPRICED))], UNPRICED
    )

    runs = sorted(
        (r for r in rows["chat"].workload.runs if r.prefix_cache_hit_rate),
        key=lambda r: r.prefix_cache_hit_rate,
    )
    [trace] = priced["data"]
    assert trace["x"] == [r.prefix_cache_hit_rate * 100 for r in runs]
    assert trace["y"] == [
        pytest.approx(2.5 / (r.request_throughput * 3600), abs=1e-6) for r in runs
    ]
    assert "no price set" in unpriced["layout"]["title"]["text"]
    assert unpriced["data"][0]["y"] == [
        pytest.approx(r.request_throughput * 3600) for r in runs
    ]


def test_it_plots_kv_capacity_once_per_kv_dtype():
    int8, bf16 = load_test_report(INT8), load_test_report(BF16)

    per_token = charts.kv_bytes_figure([("a", int8), ("b", bf16), ("c", int8)])
    sessions = charts.kv_sessions_figure([("a", int8), ("b", bf16)])

    assert per_token["data"][0]["x"] == ["int8", "bf16"]
    assert per_token["data"][0]["y"] == [
        int8.kv_bytes_per_token / 1024,
        bf16.kv_bytes_per_token / 1024,
    ]
    int8_line = sessions["data"][0]
    assert int8_line["x"] == sorted(int8_line["x"])
    assert int8_line["y"] == sorted(int8_line["y"], reverse=True)


def test_it_shows_quality_per_slice_with_its_confidence_interval(release):
    report = quality_report(release)
    english = report.slices[0]

    kld = charts.quality_kld_figure(report)
    top1 = charts.quality_top1_figure(report)

    mean = kld["data"][0]
    assert mean["x"] == [s.name for s in report.slices]
    assert mean["error_y"]["array"][0] == pytest.approx(
        english.mean_kld_ci95.high - english.mean_kld
    )
    assert top1["data"][0]["y"][0] == pytest.approx(english.same_top1 * 100)
    assert top1["data"][0]["text"][0] == f"{english.flips} flips"


def test_it_compares_cost_per_workload_as_priced_by_the_environment():
    fast = rows_of(load_test_report(INT8, speed=2.0))
    slow = rows_of(load_test_report(INT8))
    unpriced = rows_of(load_test_report(INT8), pricing=UNPRICED)

    figure = charts.cost_figure([("fast", fast, "USD"), ("slow", slow, "USD")])

    assert [trace["name"] for trace in figure["data"]] == ["fast (USD)", "slow (USD)"]
    assert figure["data"][0]["y"] == [
        float(row.costs.cost_per_1m_output_tokens) for row in fast.values()
    ]
    assert figure["data"][0]["y"][0] < figure["data"][1]["y"][0]
    assert charts.cost_figure([("unpriced", unpriced, "USD")]) is None
