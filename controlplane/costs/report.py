"""A release's money and capacity in one place, for the release page, the cost
page, its CSV and the API: the load tests of the release and of the release live in
its environment, read against the environment's gate policy (each workload's SLO)
and priced with its cost model; the capacity plan for the target traffic; and what
the verification itself cost in agent time.

The arithmetic is in capacity.py and money.py (pure); this module only reads what
they need from the database.
"""

import math
from dataclasses import dataclass, field
from decimal import Decimal

from controlplane.costs.actions import cost_model_of
from controlplane.costs.capacity import (
    CapacityPlan,
    Slo,
    UnitCosts,
    capacity_plan,
    knee,
    max_goodput,
    unit_costs,
)
from controlplane.costs.money import Pricing, format_money
from controlplane.costs.spec import CostModel
from controlplane.fleet.models import Environment
from controlplane.releases import evidence
from controlplane.releases.actions.gate_policies import gate_policy_for
from controlplane.releases.gates import GatePolicy
from controlplane.releases.models import INTEGRITY_JOB_KINDS, Release
from gpuagent.protocol import (
    LOAD_TEST_JOB_KIND,
    QUALITY_JOB_KIND,
    LoadRun,
    LoadTestReport,
    WorkloadReport,
)

MAX_TARGETS = 50
# Agent time of the verification, by what it checked.
VERIFICATION_KINDS = {
    "integrity": INTEGRITY_JOB_KINDS,
    "quality": (QUALITY_JOB_KIND,),
    "load": (LOAD_TEST_JOB_KIND,),
}


def parse_targets(text: str) -> dict[str, float]:
    """ "chat:20, rag:5.5" -> {"chat": 20.0, "rag": 5.5} (requests/s per workload);
    ValueError naming the entry that is not `workload:rate` with a rate > 0."""
    targets: dict[str, float] = {}
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        name, colon, value = (piece.strip() for piece in entry.rpartition(":"))
        if not colon or not name or not name.isprintable():
            raise ValueError(f"{entry!r} is not workload:requests_per_s, e.g. chat:20")
        try:
            rate_per_s = float(value)
        except ValueError:
            raise ValueError(f"{entry!r}: {value!r} is not a number") from None
        if not (math.isfinite(rate_per_s) and 0 < rate_per_s <= 1e9):
            raise ValueError(f"{entry!r}: the rate must be above 0 requests/s")
        if name in targets:
            raise ValueError(f"workload {name!r} is named twice")
        targets[name] = rate_per_s
    if len(targets) > MAX_TARGETS:
        raise ValueError(f"at most {MAX_TARGETS} workloads")
    return targets


def format_targets(targets: dict[str, float]) -> str:
    return ", ".join(f"{name}:{rate:g}" for name, rate in targets.items())


@dataclass(frozen=True)
class WorkloadEconomics:
    """One workload of one load test, read at its SLO and priced."""

    workload: WorkloadReport
    slo: Slo
    knee: int | None
    max_goodput: float | None
    costs: UnitCosts | None  # None: no run met the SLO
    measured_devices: int  # the devices the load test ran one replica on

    @property
    def operating_point(self) -> LoadRun | None:
        return self.costs.run if self.costs else None

    def to_dict(self) -> dict:
        run, costs = self.operating_point, self.costs
        return {
            "workload": self.workload.profile,
            "slo_ttft_p99_ms": self.slo.ttft_p99_ms,
            "slo_tpot_p99_ms": self.slo.tpot_p99_ms,
            "max_concurrency_at_slo": self.knee,
            "max_goodput": self.max_goodput,
            "requests_per_s_at_slo": costs.requests_per_s if costs else None,
            "output_tokens_per_s_at_slo": run.output_tokens_per_s if run else None,
            "ttft_p99_ms_at_slo": run.ttft_ms.p99 if run else None,
            "tpot_p99_ms_at_slo": run.tpot_ms.p99 if run else None,
            "prefix_cache_hit_rate_at_slo": run.prefix_cache_hit_rate if run else None,
            "requests_per_device_hour": (
                costs.requests_per_device_hour if costs else None
            ),
            "cost_per_request": _money(costs, "cost_per_request"),
            "cost_per_1m_input_tokens": _money(costs, "cost_per_1m_input_tokens"),
            "cost_per_1m_output_tokens": _money(costs, "cost_per_1m_output_tokens"),
        }


def _money(costs: UnitCosts | None, name: str) -> Decimal | None:
    return getattr(costs, name) if costs else None


def economics(
    report: LoadTestReport | None, policy: GatePolicy, pricing: Pricing
) -> dict[str, WorkloadEconomics]:
    """{workload: its economics} for every workload of `report` (first of a
    repeated name), in the report's order."""
    if report is None:
        return {}
    rows: dict[str, WorkloadEconomics] = {}
    for workload in report.workloads:
        if workload.profile in rows:
            continue
        slo = policy.slo_of(workload.profile, workload)
        rows[workload.profile] = WorkloadEconomics(
            workload=workload,
            slo=slo,
            knee=knee(workload, slo),
            max_goodput=max_goodput(workload),
            costs=unit_costs(workload, slo, pricing, report.gpu_count),
            measured_devices=report.gpu_count,
        )
    return rows


@dataclass(frozen=True)
class AgentTime:
    what: str  # integrity, quality, load
    seconds: float
    devices: int
    cost: Decimal | None


@dataclass(frozen=True)
class VerificationCost:
    """Agent time the release's checks took (finished jobs, every attempt the
    database kept), priced at the environment's device-hour."""

    parts: list[AgentTime]
    currency: str

    @property
    def seconds(self) -> float:
        return sum(part.seconds for part in self.parts)

    @property
    def cost(self) -> Decimal | None:
        costs = [part.cost for part in self.parts]
        return None if None in costs else sum(costs, Decimal(0))

    def to_dict(self) -> dict:
        return {
            "currency": self.currency,
            "seconds": round(self.seconds, 3),
            "cost": self.cost,
            "parts": [
                {
                    "what": part.what,
                    "seconds": round(part.seconds, 3),
                    "devices": part.devices,
                    "cost": part.cost,
                }
                for part in self.parts
            ],
        }


def verification_cost(
    release: Release, pricing: Pricing, report: LoadTestReport | None
) -> VerificationCost:
    """Seconds of agent time per kind of check, priced: integrity and quality jobs
    hold one device, the load test the devices of one replica."""
    # .all() and a filter here, so a caller's prefetch of the jobs serves it.
    jobs = [job for job in release.jobs.all() if job.duration_s is not None]
    parts = []
    for what, kinds in VERIFICATION_KINDS.items():
        seconds = sum(job.duration_s for job in jobs if job.kind in kinds)
        devices = 1
        if what == "load" and report is not None:
            devices = pricing.replica_devices(report.gpu_count)
        cost = pricing.agent_time(seconds, devices) if pricing.priced else None
        parts.append(AgentTime(what, seconds, devices, cost))
    return VerificationCost(parts, pricing.currency)


@dataclass
class EnvironmentCosts:
    """What every release of one environment is read against."""

    environment: Environment
    policy: GatePolicy
    cost_model: CostModel
    cost_model_is_default: bool
    live_release: Release | None
    live_load: LoadTestReport | None
    problems: list[str] = field(default_factory=list)

    @property
    def pricing(self) -> Pricing:
        return self.cost_model.pricing

    @property
    def warnings(self) -> list[str]:
        return pricing_warnings(
            self.environment, self.cost_model, self.cost_model_is_default
        )


def pricing_warnings(
    environment: Environment, cost_model: CostModel, is_default: bool
) -> list[str]:
    """What a reader of the numbers must know about the price: none set, or 0."""
    if cost_model.pricing.priced:
        return []
    how = (
        f"an admin sets one with PUT /api/v1/environments/{environment.pk}/"
        "cost-model or in the Django admin"
    )
    if is_default:
        return [
            f"No device price is set for {environment}: no cost is computed (a 0 "
            f"would say nothing); {how}."
        ]
    return [
        f"The device-hour of {environment} is priced at "
        f"{format_money(cost_model.pricing.device_hour_cost, cost_model.currency)}: "
        f"no cost is computed; {how}."
    ]


def environment_costs(environment: Environment, *, exclude: Release | None = None):
    """The policy, cost model and live release of `environment` (the live release
    is None when it is `exclude`: a release is not compared with itself)."""
    cost_model, is_default = cost_model_of(environment)
    problems: list[str] = []
    deployment = environment.live_deployment
    live = deployment.release if deployment is not None else None
    if exclude is not None and live is not None and live.pk == exclude.pk:
        live = None
    live_load = None
    if live is not None:
        try:
            live_load = evidence.load_report(live)
        except evidence.EvidenceUnreadable as exc:
            problems.append(exc.message)
    return EnvironmentCosts(
        environment=environment,
        policy=gate_policy_for(environment),
        cost_model=cost_model,
        cost_model_is_default=is_default,
        live_release=live,
        live_load=live_load,
        problems=problems,
    )


@dataclass
class ReleaseCosts:
    release: Release
    env: EnvironmentCosts
    load: LoadTestReport | None
    workloads: dict[str, WorkloadEconomics]
    live_workloads: dict[str, WorkloadEconomics]
    targets: dict[str, float]
    targets_source: str  # "environment" or "request"
    plan: CapacityPlan | None
    verification: VerificationCost
    problems: list[str] = field(default_factory=list)

    @property
    def live_release(self) -> Release | None:
        return self.env.live_release

    @property
    def currency(self) -> str:
        return self.env.cost_model.currency

    @property
    def notes(self) -> list[str]:
        """Facts about the numbers a reader should see beside them."""
        notes = []
        devices = self.env.cost_model.devices_per_replica
        for side, report in (("this release", self.load), ("live", self._live_load)):
            if report is not None and devices and devices != report.gpu_count:
                notes.append(
                    f"The cost model counts {devices} devices per replica; the load "
                    f"test of {side} measured one replica on {report.gpu_count}."
                )
        return notes

    @property
    def _live_load(self) -> LoadTestReport | None:
        return self.env.live_load if self.env.live_release else None


# `load` not given: release_costs reads it (a None given is "no load test").
UNREAD = object()


def release_costs(
    release: Release,
    *,
    targets: dict[str, float] | None = None,
    env: EnvironmentCosts | None = None,
    load=UNREAD,
) -> ReleaseCosts:
    """Everything money about `release`. `targets` (requests/s per workload)
    replace the environment's; `env` and `load` (its LoadTestReport, or None)
    save queries where the caller read them already."""
    problems: list[str] = []
    if env is None:
        env = environment_costs(release.target_environment, exclude=release)
    if load is UNREAD:
        load = None
        try:
            load = evidence.load_report(release)
        except evidence.EvidenceUnreadable as exc:
            problems.append(exc.message)
    problems += env.problems
    pricing = env.pricing
    live_load = env.live_load if env.live_release else None
    source = "request" if targets is not None else "environment"
    if targets is None:
        targets = dict(env.cost_model.target_requests_per_s)
    plan = None
    if targets:
        plan = capacity_plan(
            targets,
            load,
            live_load,
            env.policy.slo_of,
            pricing,
            has_live=env.live_release is not None,
        )
    return ReleaseCosts(
        release=release,
        env=env,
        load=load,
        workloads=economics(load, env.policy, pricing),
        live_workloads=economics(live_load, env.policy, pricing),
        targets=targets,
        targets_source=source,
        plan=plan,
        verification=verification_cost(release, pricing, load),
        problems=problems,
    )
