"""Capacity and unit costs from load-test numbers, checked against a plan worked
out by hand."""

from decimal import Decimal

from controlplane.costs.capacity import (
    Slo,
    capacity_plan,
    knee,
    operating_point,
    unit_costs,
)
from controlplane.costs.money import Pricing
from gpuagent.protocol import LoadRun, LoadTestReport, WorkloadReport
from tests.controlplane.releases.test_evaluate_policy import pct

SLO = Slo(ttft_p99_ms=2000, tpot_p99_ms=100)
# 2 USD per device-hour; one replica holds 2 devices (the load test ran on 1).
PRICING = Pricing("USD", Decimal("2.00"), devices_per_replica=2)


def run(requests_per_s, *, concurrency=None, rate=None, ttft=300.0, tpot=40.0):
    return LoadRun(
        concurrency=concurrency,
        request_rate=rate,
        num_requests=100,
        num_errors=0,
        duration_s=30,
        ttft_ms=pct(ttft),
        tpot_ms=pct(tpot),
        itl_ms=pct(tpot),
        e2e_ms=pct(5000),
        request_throughput=requests_per_s,
        output_tokens_per_s=requests_per_s * 200,
        goodput=requests_per_s,
        meets_slo=True,
        valid=True,
        prompt_tokens=500,
    )


def workload(profile: str, runs: list[LoadRun]) -> WorkloadReport:
    return WorkloadReport(
        profile=profile,
        prompt_tokens=500,
        output_tokens=200,
        context_tokens=700,
        slo_ttft_p99_ms=5000,
        slo_tpot_p99_ms=150,
        runs=runs,
        max_sessions_at_context=100,
    )


def report(*workloads: WorkloadReport) -> LoadTestReport:
    return LoadTestReport(
        endpoint="http://127.0.0.1:9000",
        gpu_hourly_usd=99.0,  # the agent's own price: ignored
        gpu_count=1,
        weights_bytes=10**9,
        kv_budget_bytes=8 * 2**30,
        kv_bytes_per_token=4096,
        kv_cache_dtype="int8",
        workloads=list(workloads),
    )


CANDIDATE = report(
    workload(
        "chat",
        [
            run(2.0, concurrency=4),
            run(3.5, concurrency=8, tpot=60),
            run(5.0, concurrency=16, tpot=120),  # misses TPOT 100
            run(4.0, rate=4.0, tpot=90),  # open loop, meets
        ],
    ),
    workload(
        "rag",
        [run(0.5, concurrency=2, ttft=1500), run(0.8, concurrency=4, ttft=2500)],
    ),
)
LIVE = report(
    workload("chat", [run(1.5, concurrency=4), run(2.5, concurrency=8)]),
    workload("rag", [run(0.3, concurrency=2)]),
)


def test_it_reads_the_knee_and_operating_point_at_the_slo():
    chat = CANDIDATE.workloads[0]

    assert knee(chat, SLO) == 8  # 16 missed TPOT
    assert operating_point(chat, SLO).request_rate == 4.0  # the most req/s meeting
    assert knee(chat, Slo(tpot_p99_ms=150)) == 16  # another policy, another knee


def test_it_prices_a_workload_at_its_operating_point():
    """chat at 4.0 req/s (800 output tokens/s, 500 prompt tokens each) on a
    replica of 2 devices at 2.00 USD: a replica-hour is 4.00 USD.
    per request:        4 / (4.0 x 3600)              = 0.000277... -> 0.000278
    per 1M output tok.: 4 / (800 x 3600) x 1e6        = 1.388888... -> 1.388889
    per 1M input tok.:  4 / (4.0 x 500 x 3600) x 1e6  = 0.555555... -> 0.555556
    requests per device-hour: 4.0 x 3600 / 2          = 7200"""
    costs = unit_costs(CANDIDATE.workloads[0], SLO, PRICING, measured_devices=1)

    assert costs.devices_per_replica == 2
    assert costs.cost_per_request == Decimal("0.000278")
    assert costs.cost_per_1m_output_tokens == Decimal("1.388889")
    assert costs.cost_per_1m_input_tokens == Decimal("0.555556")
    assert costs.requests_per_device_hour == 7200


def test_it_plans_devices_and_money_for_a_target_traffic():
    """Targets: chat 8.8 req/s, rag 2.1 req/s; 2 devices per replica at 2.00 USD a
    device-hour, 730 h a month: a device-month is 1,460.00 USD.

    candidate: chat serves 4.0 req/s per replica -> 8.8 / 4.0 = 2.2 -> 3 replicas,
      6 devices, 6 x 1,460 = 8,760.00 USD; rag 0.5 -> 2.1 / 0.5 = 4.2 -> 5
      replicas, 10 devices, 14,600.00 USD; one pool: 2.2 + 4.2 = 6.4 -> 7
      replicas (not 3 + 5), 14 devices, 20,440.00 USD.
    live: chat 2.5 -> 3.52 -> 4 replicas, 8 devices, 11,680.00 USD; rag 0.3 ->
      2.1 / 0.3 = 7 exactly (in floats 7.000000000000001, which would be 8) -> 7
      replicas, 14 devices, 20,440.00 USD; one pool: 10.52 -> 11 replicas, 22
      devices, 32,120.00 USD.
    difference: chat -2 devices, -2,920.00 USD; rag -4, -5,840.00; pool -8,
      -11,680.00 USD a month."""
    plan = capacity_plan(
        {"chat": 8.8, "rag": 2.1},
        CANDIDATE,
        LIVE,
        lambda name, workload: SLO,
        PRICING,
        has_live=True,
    )

    chat, rag = plan.rows
    assert (chat.candidate.replicas, chat.candidate.devices) == (3, 6)
    assert chat.candidate.monthly_cost == Decimal("8760.00")
    assert (chat.live.replicas, chat.live.devices) == (4, 8)
    assert chat.live.monthly_cost == Decimal("11680.00")
    assert (chat.device_difference, chat.monthly_difference) == (
        -2,
        Decimal("-2920.00"),
    )
    assert (rag.candidate.replicas, rag.candidate.devices) == (5, 10)
    assert rag.candidate.monthly_cost == Decimal("14600.00")
    assert (rag.live.replicas, rag.live.devices) == (7, 14)
    assert (rag.device_difference, rag.monthly_difference) == (
        -4,
        Decimal("-5840.00"),
    )
    total = plan.total
    assert (total.candidate.replicas, total.candidate.devices) == (7, 14)
    assert total.candidate.monthly_cost == Decimal("20440.00")
    assert (total.live.replicas, total.live.devices) == (11, 22)
    assert total.live.monthly_cost == Decimal("32120.00")
    assert (total.device_difference, total.monthly_difference) == (
        -8,
        Decimal("-11680.00"),
    )


def test_it_says_why_a_side_has_no_number():
    plan = capacity_plan(
        {"code": 1.0, "chat": 1.0},
        CANDIDATE,
        None,
        lambda name, workload: Slo(tpot_p99_ms=10),  # nothing meets it
        PRICING,
        has_live=True,
    )
    first = capacity_plan(
        {"chat": 1.0}, CANDIDATE, None, lambda n, w: SLO, PRICING, has_live=False
    )

    chat, code = plan.rows  # measured first, in the load test's order
    assert code.candidate.missing == "the candidate did not measure this workload"
    assert chat.candidate.missing == "no load level of the candidate met the SLO"
    assert chat.live.missing == "live has no load test"
    assert chat.device_difference is None and plan.total.candidate.devices is None
    assert first.rows[0].live is None and first.rows[0].device_difference is None


def test_it_plans_devices_but_no_money_without_a_price():
    plan = capacity_plan(
        {"chat": 8.8},
        CANDIDATE,
        None,
        lambda name, workload: SLO,
        Pricing("KRW", Decimal(0)),
        has_live=False,
    )

    [chat] = plan.rows
    assert chat.candidate.devices == 3  # the load test's 1 device per replica
    assert chat.candidate.monthly_cost is None


def test_it_lists_workloads_in_the_load_tests_order_whatever_the_maps_order():
    """The stored targets map has no order of its own (PostgreSQL's jsonb sorts
    keys by length, 'rag' before 'chat'): rows follow the load test's workloads,
    then the unmeasured ones by name."""
    plan = capacity_plan(
        {"zeta": 1.0, "rag": 1.0, "alpha": 1.0, "chat": 1.0},
        CANDIDATE,
        LIVE,
        lambda name, workload: SLO,
        PRICING,
        has_live=True,
    )

    assert [row.workload for row in plan.rows] == ["chat", "rag", "alpha", "zeta"]
