"""A load plan against a scripted server of known capacity (its own process):
the knee search and the stepped sweep find the capacity it is throttled to,
open-loop goodput follows the offered rate below capacity and stays under it
above, the budget stops a plan and names what it skipped, and a client that
falls behind is run again."""

import asyncio

import pytest

from gpuagent.loadtest import metrics
from gpuagent.loadtest.plan_runner import run_plan, search_levels
from gpuagent.protocol import LoadPlan

# 8 tokens: the first 20 ms after a stream starts, then one every 40 ms: a stream
# holds its slot ~300 ms, so one waiting for a slot starts its first token >= 300
# ms late, past a TTFT SLO of 150 ms that a stream with a free slot meets (with
# 130 ms to spare for a CPU other processes share).
SERVER = ["--ttft-ms", "20", "--itl-ms", "40", "--tokens", "8"]
WORKLOAD = {
    "name": "chat",
    "task": "chat",
    "language": "en",
    "prompt": {"tokens": 64},
    "output": {"tokens": 8},
    "slo_ttft_p99_ms": 150.0,
    "slo_tpot_p99_ms": 1000.0,
}


@pytest.fixture(autouse=True)
def _a_busy_client_is_not_the_server(monkeypatch):
    """The client's own health is checked elsewhere; here, on a CPU other
    processes share, a late timer must not pass for the server's knee."""
    monkeypatch.setattr(metrics, "MAX_LOOP_LAG_P99_MS", 1000.0)
    monkeypatch.setattr(metrics, "MAX_SCHEDULE_LAG_MS", 1000.0)


def plan(sweeps: dict, budget_s: float = 120.0, workloads=None) -> LoadPlan:
    return LoadPlan.model_validate(
        {"workloads": workloads or [WORKLOAD], "sweeps": sweeps, "budget_s": budget_s}
    )


def concurrency(mode: str = "search", **more) -> dict:
    sweep = {"mode": mode, "max_concurrency": 16, "requests_per_level": 8}
    return {"concurrency": sweep | more, "context": None, "rates": None}


def test_it_bisects_between_the_last_good_and_the_first_bad_level():
    assert search_levels({}, 16) == 1
    assert search_levels({1: True, 2: True, 4: True}, 16) == 8
    assert search_levels({1: True, 2: True, 4: True, 8: False}, 16) == 6
    assert search_levels({1: True, 2: True, 4: True, 8: False, 6: False}, 16) == 5
    assert search_levels({4: True, 8: False, 6: False, 5: True}, 16) is None
    assert search_levels({1: True, 2: True}, 2) is None  # met at the ceiling
    assert search_levels({1: False}, 16) is None  # not even one: no knee


@pytest.mark.parametrize("capacity", [3, 5])
def test_the_knee_search_finds_the_capacity_the_server_is_throttled_to(
    scripted, capacity
):
    with scripted(*SERVER, "--max-concurrent", str(capacity)) as url:
        report = asyncio.run(run_plan(url, plan(concurrency())))

    (workload,) = report.workloads
    assert workload.knee_concurrency == capacity
    levels = {r.concurrency: r.meets_slo for r in workload.runs}
    assert levels[capacity] and not levels[capacity + 1]
    assert [r.concurrency for r in workload.runs] == sorted(levels)  # the curve
    assert report.skipped_for_budget == []
    assert report.plan == plan(concurrency())  # the plan that ran travels along


def test_a_stepped_sweep_stops_at_the_first_level_that_breaks_the_slo(scripted):
    sweeps = concurrency("stepped", levels=[1, 2, 3, 4, 5, 6])
    with scripted(*SERVER, "--max-concurrent", "3") as url:
        report = asyncio.run(run_plan(url, plan(sweeps)))

    (workload,) = report.workloads
    assert [r.concurrency for r in workload.runs] == [1, 2, 3, 4]
    assert workload.knee_concurrency == 3


def test_open_loop_goodput_follows_the_rate_below_capacity_and_not_above(scripted):
    # four slots of ~300 ms: at most 13.3 requests/s within the SLO
    sweeps = {
        "concurrency": None,
        "context": None,
        "rates": {"rates": [1, 60], "requests_per_level": 30, "retries": 0},
    }
    with scripted(*SERVER, "--max-concurrent", "4") as url:
        report = asyncio.run(run_plan(url, plan(sweeps)))

    low, high = report.workloads[0].runs
    assert (low.request_rate, high.request_rate) == (1, 60)
    assert low.meets_slo and low.goodput == pytest.approx(low.request_throughput)
    assert not high.meets_slo
    assert high.goodput <= 13.3 and high.goodput < 0.5 * high.request_throughput
    assert report.workloads[0].max_goodput == max(low.goodput, high.goodput)
    # the scripted server counts no prefix cache: no hit rate is made up
    assert low.prefix_cache_hit_rate is None and low.cached_tokens is None


def test_the_budget_stops_a_plan_and_names_the_points_it_skipped(scripted):
    sweeps = concurrency("stepped", levels=[1, 2, 4, 8], requests_per_level=400)
    second = WORKLOAD | {"name": "chat-2"}
    with scripted(*SERVER) as url:  # no throttle: every level meets the SLO
        report = asyncio.run(run_plan(url, plan(sweeps, 4.0, [WORKLOAD, second])))

    assert report.wall_s < 4.0 + 1.0
    assert report.budget_s == 4.0
    first = report.workloads[0]
    assert first.runs[0].cut_by_budget  # 400 requests don't fit its 2 s share
    assert "chat c=2" in report.skipped_for_budget
    assert "chat c=8" in report.skipped_for_budget
    assert [w.profile for w in report.workloads] == ["chat", "chat-2"]  # its share


def test_requests_in_flight_at_the_budgets_end_are_stopped(scripted):
    sweeps = concurrency("stepped", levels=[2])
    slow = ["--ttft-ms", "20", "--itl-ms", "20", "--tokens", "400"]  # 8 s each
    with scripted(*slow) as url:
        report = asyncio.run(run_plan(url, plan(sweeps, 2.0)))

    assert report.wall_s < 2.0 + 1.0
    (run,) = report.workloads[0].runs
    assert run.cut_by_budget and run.num_requests == 0 and run.num_errors == 0


def test_a_client_that_falls_behind_says_so_and_is_run_again(scripted, monkeypatch):
    monkeypatch.setattr(metrics, "MAX_SCHEDULE_LAG_MS", -1.0)  # always behind
    sweeps = {
        "concurrency": None,
        "context": None,
        "rates": {"rates": [5], "requests_per_level": 4, "retries": 2},
    }
    with scripted(*SERVER) as url:
        report = asyncio.run(run_plan(url, plan(sweeps)))

    (run,) = report.workloads[0].runs
    assert not run.valid and run.retries == 2
    assert report.workloads[0].max_goodput is None  # an invalid run is no evidence
