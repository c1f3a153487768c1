"""Capacity and unit cost from a load test's physical numbers: pure functions.

A workload's *SLO* is the gate policy's latency thresholds for it (p99 TTFT and TPOT;
an unset one does not limit). A run meets it when the load client kept its schedule,
nothing failed, some request completed and both p99s are within it. The *operating
point* is the run meeting it with the most requests/s (closed- or open-loop); the
*knee* the highest closed-loop concurrency meeting it. One replica (one endpoint, as
the load test measured it) serves the operating point's requests/s.

Unit costs at the operating point, with a replica-hour = devices per replica x the
cost of a device-hour (price + electricity):
  cost per request         = replica-hour / (requests/s x 3600)
  cost per 1M output tok.  = replica-hour / (output tokens/s x 3600) x 1e6
  cost per 1M input tok.   = replica-hour / (requests/s x prompt tokens x 3600) x 1e6
  requests per device-hour = requests/s x 3600 / devices per replica
Each per-token cost lays the whole replica-hour on that kind of token (the price of
tokens served alone); input and output costs are two views, not parts to add.

Capacity plan for a target rate T of a workload served at R requests/s per replica:
replicas = ceil(T / R), devices = replicas x devices per replica, a month = devices x
device-hour x 730 h. Several workloads on one shared pool take ceil(sum of T / R)
replicas: each workload uses its share of a replica's time.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal

from controlplane.costs.money import (
    MILLION,
    SECONDS_PER_HOUR,
    Pricing,
    decimal_of,
    rate,
)
from gpuagent.protocol import LoadRun, LoadTestReport, WorkloadReport


@dataclass(frozen=True)
class Slo:
    """p99 latency bounds a run must meet (None: not bounded)."""

    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None

    def met_by(self, run: LoadRun) -> bool:
        return (
            run.valid
            and run.num_errors == 0
            and run.request_throughput > 0
            and (self.ttft_p99_ms is None or run.ttft_ms.p99 <= self.ttft_p99_ms)
            and (self.tpot_p99_ms is None or run.tpot_ms.p99 <= self.tpot_p99_ms)
        )


def operating_point(workload: WorkloadReport, slo: Slo) -> LoadRun | None:
    """The run meeting `slo` with the most requests/s; None when none does."""
    meeting = [run for run in workload.runs if slo.met_by(run)]
    return max(meeting, key=lambda run: run.request_throughput, default=None)


def knee(workload: WorkloadReport, slo: Slo) -> int | None:
    """The highest closed-loop concurrency meeting `slo` (max concurrency at SLO)."""
    return max(
        (
            run.concurrency
            for run in workload.runs
            if run.concurrency is not None and slo.met_by(run)
        ),
        default=None,
    )


def max_goodput(workload: WorkloadReport) -> float | None:
    """The most requests/s that met the SLO, over the runs whose client kept its
    schedule; None without such a run."""
    return max((run.goodput for run in workload.runs if run.valid), default=None)


def prompt_tokens_of(run: LoadRun, workload: WorkloadReport) -> int:
    """Mean prompt tokens of the run's requests (from usage), else the workload's."""
    return run.prompt_tokens or workload.prompt_tokens


@dataclass(frozen=True)
class UnitCosts:
    """One workload at its operating point. Money is None where the environment
    has no price (Pricing.priced) or the rate it divides by is 0."""

    run: LoadRun
    devices_per_replica: int
    requests_per_s: float
    requests_per_device_hour: float
    cost_per_request: Decimal | None = None
    cost_per_1m_input_tokens: Decimal | None = None
    cost_per_1m_output_tokens: Decimal | None = None


def _per(
    replica_hour: Decimal, per_s: float, pricing: Pricing, scale=Decimal(1)
) -> Decimal | None:
    if not pricing.priced or per_s <= 0:
        return None
    per_hour = decimal_of(per_s) * SECONDS_PER_HOUR
    return rate(replica_hour / per_hour * scale, pricing.currency)


def run_costs(
    run: LoadRun, workload: WorkloadReport, pricing: Pricing, measured_devices: int
) -> UnitCosts:
    """Unit costs if `run` were the operating point (see the module docstring)."""
    devices = pricing.replica_devices(measured_devices)
    replica_hour = devices * pricing.device_hour_cost
    input_per_s = run.request_throughput * prompt_tokens_of(run, workload)
    return UnitCosts(
        run=run,
        devices_per_replica=devices,
        requests_per_s=run.request_throughput,
        requests_per_device_hour=run.request_throughput * 3600 / devices,
        cost_per_request=_per(replica_hour, run.request_throughput, pricing),
        cost_per_1m_input_tokens=_per(replica_hour, input_per_s, pricing, MILLION),
        cost_per_1m_output_tokens=_per(
            replica_hour, run.output_tokens_per_s, pricing, MILLION
        ),
    )


def unit_costs(
    workload: WorkloadReport, slo: Slo, pricing: Pricing, measured_devices: int
) -> UnitCosts | None:
    """Unit costs at the operating point; None when no run meets `slo`."""
    run = operating_point(workload, slo)
    if run is None:
        return None
    return run_costs(run, workload, pricing, measured_devices)


@dataclass(frozen=True)
class Side:
    """One release's part of a capacity plan row (candidate or live)."""

    requests_per_s_per_replica: float | None = None
    replicas: int | None = None
    devices: int | None = None
    monthly_cost: Decimal | None = None
    # Why there is no number: no load test, workload not measured, no run met the
    # SLO; "" when there is one.
    missing: str = ""


@dataclass(frozen=True)
class PlanRow:
    workload: str
    target_requests_per_s: float
    candidate: Side
    live: Side | None  # None: nothing live to compare with

    @property
    def device_difference(self) -> int | None:
        """Candidate devices - live devices (negative: the candidate needs fewer)."""
        if self.live is None or None in (self.candidate.devices, self.live.devices):
            return None
        return self.candidate.devices - self.live.devices

    @property
    def monthly_difference(self) -> Decimal | None:
        if self.live is None:
            return None
        if None in (self.candidate.monthly_cost, self.live.monthly_cost):
            return None
        return self.candidate.monthly_cost - self.live.monthly_cost


@dataclass
class CapacityPlan:
    currency: str
    rows: list[PlanRow] = field(default_factory=list)
    total: PlanRow | None = None


def _side(
    target: float,
    report: LoadTestReport | None,
    workload: WorkloadReport | None,
    slo: Slo,
    pricing: Pricing,
    what: str,
) -> tuple[Side, Decimal | None]:
    """(the side of a row, its share of replica time: target / per-replica rate,
    in Decimal so 0.9 / 0.3 is 3 replicas, not 3.0000000000000004 -> 4); the share
    is None when the side has no number."""
    if report is None:
        return Side(missing=f"{what} has no load test"), None
    if workload is None:
        return Side(missing=f"{what} did not measure this workload"), None
    run = operating_point(workload, slo)
    if run is None:
        return Side(missing=f"no load level of {what} met the SLO"), None
    per_replica = run.request_throughput
    share = decimal_of(target) / decimal_of(per_replica)
    replicas = math.ceil(share)
    devices = replicas * pricing.replica_devices(report.gpu_count)
    monthly = pricing.monthly(devices) if pricing.priced else None
    return Side(per_replica, replicas, devices, monthly), share


def _workloads(report: LoadTestReport | None) -> dict[str, WorkloadReport]:
    return {w.profile: w for w in report.workloads} if report else {}


def _in_measured_order(
    targets: dict[str, float], *reports: LoadTestReport | None
) -> list[str]:
    """The targets' workload names in the order the load tests measured them
    (the load plan's order), the unmeasured ones after by name. The stored map
    keeps no order of its own: PostgreSQL's jsonb sorts keys by length."""
    measured = [w.profile for r in reports if r for w in r.workloads]
    rank = {name: i for i, name in reversed(list(enumerate(measured)))}
    return sorted(targets, key=lambda name: (rank.get(name, len(rank)), name))


def capacity_plan(
    targets: dict[str, float],
    candidate: LoadTestReport | None,
    live: LoadTestReport | None,
    slo_of,
    pricing: Pricing,
    *,
    has_live: bool,
) -> CapacityPlan:
    """Devices the candidate and the live release need for `targets` (requests/s
    per workload) at each workload's SLO (`slo_of(name, workload)` -> Slo), and a
    total for one shared pool. `has_live` False: nothing is live, so rows have no
    live side."""
    plan = CapacityPlan(currency=pricing.currency)
    shares: dict[str, list[Decimal | None]] = {"candidate": [], "live": []}
    candidate_workloads, live_workloads = _workloads(candidate), _workloads(live)
    for name in _in_measured_order(targets, candidate, live):
        target = targets[name]
        mine = candidate_workloads.get(name)
        theirs = live_workloads.get(name)
        slo = slo_of(name, mine or theirs)
        side, share = _side(target, candidate, mine, slo, pricing, "the candidate")
        shares["candidate"].append(share)
        live_side = None
        if has_live:
            live_side, share = _side(target, live, theirs, slo, pricing, "live")
            shares["live"].append(share)
        plan.rows.append(PlanRow(name, target, side, live_side))
    if plan.rows:
        plan.total = PlanRow(
            "all (one shared pool)",
            sum(targets.values()),
            _pooled(shares["candidate"], candidate, pricing, "the candidate"),
            _pooled(shares["live"], live, pricing, "live") if has_live else None,
        )
    return plan


def _pooled(
    shares: Iterable[Decimal | None],
    report: LoadTestReport | None,
    pricing: Pricing,
    what: str,
) -> Side:
    shares = list(shares)
    if report is None or None in shares:
        return Side(missing=f"{what} lacks a number for some workload")
    replicas = math.ceil(sum(shares))
    devices = replicas * pricing.replica_devices(report.gpu_count)
    monthly = pricing.monthly(devices) if pricing.priced else None
    return Side(None, replicas, devices, monthly)
