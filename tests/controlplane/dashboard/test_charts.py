from types import SimpleNamespace

import pytest

from controlplane.dashboard import charts
from tests.controlplane.dashboard.builders import load_test_report, quality_report

INT8 = {"weights": "int4-g128", "kv_cache_dtype": "int8"}
BF16 = {"weights": "bf16", "kv_cache_dtype": "bf16"}


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


def test_it_draws_nothing_without_reports():
    assert charts.memory_figure([("candidate", None)]) is None
    assert charts.throughput_figure(None) is None
    assert charts.latency_figure(None, "ttft_ms") is None
    assert charts.quality_kld_figure(None) is None
    assert charts.cost_figure([]) is None
    assert charts.timeline_figure([]) is None


def test_it_marks_runs_that_missed_the_slo_on_the_throughput_curve():
    report = load_test_report(INT8)

    figure = charts.throughput_figure(report)

    chat = figure["data"][0]
    runs = report.workloads[0].runs
    assert chat["x"] == [r.concurrency for r in runs]
    assert chat["y"] == [r.output_tokens_per_s for r in runs]
    assert chat["marker"]["symbol"] == ["circle" if r.meets_slo else "x" for r in runs]
    assert "x" in chat["marker"]["symbol"]


def test_it_shows_latency_at_the_highest_load_meeting_the_slo():
    report = load_test_report(INT8)
    chat = report.workloads[0]
    headline = charts.headline_run(chat)

    figure = charts.latency_figure(report, "tpot_ms")

    assert headline.concurrency == chat.max_concurrency_at_slo
    p99 = next(trace for trace in figure["data"] if trace["name"] == "p99")
    assert p99["y"][0] == headline.tpot_ms.p99
    assert figure["data"][-1]["y"][0] == chat.slo_tpot_p99_ms


def test_it_takes_the_highest_load_when_none_met_the_slo():
    runs = [SimpleNamespace(meets_slo=False, valid=True, concurrency=c) for c in (1, 8)]

    assert charts.headline_run(SimpleNamespace(runs=runs)).concurrency == 8


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


def test_it_compares_cost_per_workload():
    fast, slow = load_test_report(INT8, speed=2.0), load_test_report(INT8)

    figure = charts.cost_figure([("fast", fast), ("slow", slow)])

    assert [trace["name"] for trace in figure["data"]] == ["fast", "slow"]
    assert figure["data"][0]["y"] == [
        w.cost_per_1m_output_tokens for w in fast.workloads
    ]
