"""guidellm's JSON report read into our LoadRuns (gpuagent.loadtest.guidellm_results),
without guidellm: tests/data/guidellm-0.8.1-report.json is the output of two real
runs of guidellm 0.8.1 against this engine serving the demo model (concurrent at 1
and 2 streams, 4 requests each; Poisson at 4/s, 6 requests), trimmed to the fields
read (its "_source" says so)."""

import copy
import json
from pathlib import Path

import pytest

from gpuagent.loadtest.guidellm_results import (
    GuidellmReportError,
    record_of,
    run_of,
    runs_of,
)
from gpuagent.loadtest.metrics import MAX_SCHEDULE_LAG_MS

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "guidellm-0.8.1-report.json"
LOOSE = (60_000.0, 60_000.0)  # an SLO every request meets


@pytest.fixture
def report() -> dict:
    return json.loads(FIXTURE.read_text())


def test_it_times_each_request_as_guidellm_did(report):
    # our TTFT and TPOT ((E2E - TTFT) / (n - 1)) from its timestamps are its own
    # per-request time_to_first_token_ms and inter_token_latency_ms
    requests = [r for b in report["benchmarks"] for r in b["requests"]["successful"]]
    assert len(requests) == 14
    for request in requests:
        record = record_of(request)
        assert record.ok
        assert record.ttft_s * 1e3 == pytest.approx(request["time_to_first_token_ms"])
        assert record.tpot_s * 1e3 == pytest.approx(request["inter_token_latency_ms"])
        assert (record.prompt_tokens, record.output_tokens) == (70, 16)


def test_it_reads_each_benchmarks_load(report):
    runs = runs_of(report, *LOOSE)

    assert [(r.concurrency, r.request_rate, r.arrival) for r in runs] == [
        (1, None, "closed"),
        (2, None, "closed"),
        (None, 4.0, "poisson"),
    ]
    assert [r.num_requests for r in runs] == [4, 4, 6]
    assert all(r.meets_slo and r.valid for r in runs)


def test_its_throughput_and_duration_are_guidellms(report):
    for benchmark, run in zip(
        report["benchmarks"], runs_of(report, *LOOSE), strict=True
    ):
        guidellms = benchmark["metrics"]["requests_per_second"]["successful"]["mean"]
        assert run.request_throughput == pytest.approx(guidellms)
        assert run.duration_s == pytest.approx(benchmark["duration"])
        assert run.output_tokens == 16 * run.num_requests


def test_it_judges_the_requests_by_our_slo(report):
    benchmark = report["benchmarks"][1]  # c=2
    ttfts = sorted(
        r["time_to_first_token_ms"] for r in benchmark["requests"]["successful"]
    )
    slo_ttft = (ttfts[1] + ttfts[2]) / 2  # two requests meet it, two don't

    run = run_of(benchmark, slo_ttft, 60_000.0)

    assert not run.meets_slo  # its p99 is over
    assert run.goodput == pytest.approx(2 / benchmark["duration"])
    assert run_of(benchmark, *LOOSE).goodput == pytest.approx(4 / benchmark["duration"])


def test_it_holds_a_poisson_clients_lag_to_our_limit(report):
    benchmark = report["benchmarks"][2]
    assert run_of(benchmark, *LOOSE).max_schedule_lag_ms == pytest.approx(
        22.556, abs=1e-3
    )

    late = copy.deepcopy(benchmark)
    timings = late["requests"]["successful"][3]["info"]["timings"]
    timings["targeted_start"] -= (MAX_SCHEDULE_LAG_MS + 50) / 1e3
    run = run_of(late, *LOOSE)

    assert not run.valid and not run.meets_slo
    assert run.max_schedule_lag_ms > MAX_SCHEDULE_LAG_MS


def test_a_closed_loop_has_no_schedule_to_lag(report):
    assert run_of(report["benchmarks"][0], *LOOSE).max_schedule_lag_ms == 0.0


def test_an_errored_request_is_an_error_and_an_incomplete_one_left_out(report):
    # the fixture's runs had neither: requests of the real run are moved there
    benchmark = copy.deepcopy(report["benchmarks"][0])
    successful = benchmark["requests"]["successful"]
    failed, cut = successful.pop(), successful.pop()
    failed["info"]["error"] = "HTTPStatusError: 500"
    benchmark["requests"]["errored"] = [failed]
    benchmark["requests"]["incomplete"] = [cut]

    run = run_of(benchmark, *LOOSE)

    assert (run.num_requests, run.num_errors) == (2, 1)
    assert run.errors == ["HTTPStatusError: 500"]
    assert not run.meets_slo


def test_it_claims_no_chunk_gaps(report):
    # guidellm keeps no time per chunk: no ITL rather than a made-up one
    run = run_of(report["benchmarks"][0], *LOOSE)

    assert run.itl_ms.p50 == run.itl_ms.p99 == 0.0
    assert run.tpot_ms.p50 > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b["config"]["strategy"].update(type_="throughput"), "throughput"),
        (lambda b: b.pop("config"), "config.strategy"),
        (lambda b: b["requests"].pop("successful"), "requests.successful"),
        (
            lambda b: b["requests"]["successful"][0]["info"].pop("timings"),
            "info.timings",
        ),
        (
            lambda b: b["requests"]["successful"][0]["info"]["timings"].pop(
                "request_start"
            ),
            "request_start",
        ),
    ],
)
def test_it_refuses_what_it_cant_read_by_name(report, change, message):
    benchmark = report["benchmarks"][0]
    change(benchmark)

    with pytest.raises(GuidellmReportError, match=message):
        run_of(benchmark, *LOOSE)


def test_a_report_without_benchmarks_is_refused():
    with pytest.raises(GuidellmReportError, match="no benchmarks"):
        runs_of({"benchmarks": []}, *LOOSE)
