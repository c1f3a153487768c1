"""Gates on how much one device holds and what it costs, against the release live
in the environment and against fixed limits: pure functions, no Django.

Each workload is read at its SLO (the policy's latency thresholds): its knee (max
concurrency at the SLO), its best goodput, and its unit costs at the operating point,
priced with the environment's cost model (controlplane.costs). Without a live
release (an environment's first) one "live" outcome says so as skipped; a live
release without a load test, or a workload it never measured, is inconclusive.
"""

from dataclasses import dataclass
from typing import Protocol

from controlplane.costs.capacity import Slo, knee, max_goodput, unit_costs
from controlplane.costs.money import Pricing, decimal_of
from controlplane.releases.gate_outcomes import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIPPED,
    GateOutcome,
    compare,
)
from gpuagent.protocol import LoadTestReport, WorkloadReport


class Limits(Protocol):
    """What these checks read of a workload's thresholds (gates.WorkloadThresholds,
    which imports this module)."""

    @property
    def slo(self) -> Slo: ...

    max_concurrency_drop_pct: float | None
    max_goodput_drop_pct: float | None
    max_cost_increase_pct: float | None


@dataclass(frozen=True)
class LiveBaseline:
    """The release live in the candidate's environment: its name and its load
    test (None: it has none)."""

    release: str
    load: LoadTestReport | None
    # Why `load` is None when the live release recorded one that doesn't validate.
    problem: str = ""


def baseline(
    live: LiveBaseline | None, comparing: bool
) -> tuple[LoadTestReport | None, list[GateOutcome]]:
    """(live's load test to compare with, or None; the one "live" outcome that
    says why there is none) where a check of the policy compares (`comparing`)."""
    if not comparing:
        return None, []
    if live is None:
        return None, [
            GateOutcome(
                "live",
                "baseline",
                None,
                None,
                SKIPPED,
                "nothing is live in this environment (its first release): no "
                "baseline, so capacity and cost are not compared with live; the "
                "other gates decide",
            )
        ]
    if live.load is None:
        return None, [
            GateOutcome(
                "live",
                "baseline",
                None,
                None,
                INCONCLUSIVE,
                f"no evidence: live {live.release} has no load test to compare "
                f"with{': ' + live.problem if live.problem else ''}",
            )
        ]
    return live.load, []


def cost(gate, costs, limit: float, pricing: Pricing, metric: str) -> GateOutcome:
    """Cost per 1M output tokens at the SLO operating point against `limit`."""
    if costs is None:
        return GateOutcome(
            gate,
            metric,
            None,
            limit,
            FAIL,
            "no load level met the SLO, so it has no cost at the SLO",
        )
    if costs.cost_per_1m_output_tokens is None:
        return GateOutcome(gate, metric, None, limit, INCONCLUSIVE, _unpriced(pricing))
    observed = float(costs.cost_per_1m_output_tokens)
    outcome = compare(gate, metric, observed, limit, "max")
    return GateOutcome(
        gate,
        metric,
        observed,
        limit,
        outcome.outcome,
        f"{outcome.reason} {pricing.currency} per 1M output tokens",
    )


def _unpriced(pricing: Pricing) -> str:
    return (
        f"no evidence: a device-hour costs 0 {pricing.currency} in this "
        "environment's cost model, so there is no cost to judge"
    )


def hit_rate(gate, costs, minimum: float) -> GateOutcome:
    metric = "prefix_cache_hit_rate"
    if costs is None:
        return GateOutcome(
            gate,
            metric,
            None,
            minimum,
            INCONCLUSIVE,
            "no evidence: no load level met the SLO, and the hit rate is read at "
            "the SLO operating point",
        )
    observed = costs.run.prefix_cache_hit_rate
    if observed is None:
        return GateOutcome(
            gate,
            metric,
            None,
            minimum,
            INCONCLUSIVE,
            "no evidence: the server reported no prefix-cache hit rate",
        )
    return compare(gate, metric, observed, minimum, "min")


def _drop(
    gate: str, metric: str, mine: float | None, theirs: float | None, pct: float, what
) -> GateOutcome:
    """`mine` may be at most `pct`% below live's `theirs`."""
    if mine is None or theirs is None:
        whose = "this release" if mine is None else "live"
        return GateOutcome(
            gate,
            metric,
            mine,
            None,
            INCONCLUSIVE,
            f"no evidence: {whose} did not measure {what}",
        )
    floor_value = theirs * (1 - pct / 100)
    if theirs <= 0:
        return GateOutcome(
            gate, metric, mine, floor_value, PASS, f"live has no {what} to drop from"
        )
    change = (mine - theirs) / theirs * 100
    ok = mine >= floor_value
    return GateOutcome(
        gate,
        metric,
        mine,
        floor_value,
        PASS if ok else FAIL,
        f"{what} {mine:.4g} vs live {theirs:.4g}: {change:+.1f}% "
        f"({'within' if ok else 'beyond'} the -{pct:g}% allowed)",
    )


def _knee(workload: WorkloadReport, slo: Slo) -> int | None:
    """Max concurrency at the SLO; 0 when closed-loop runs met it at no level,
    None without a closed-loop run whose client kept its schedule (not measured)."""
    if not any(run.concurrency is not None and run.valid for run in workload.runs):
        return None
    return knee(workload, slo) or 0


def versus_live(
    workload: WorkloadReport,
    t: Limits,
    pricing: Pricing,
    report: LoadTestReport,
    live_report: LoadTestReport,
    live_release: str,
) -> list[GateOutcome]:
    gate = f"load:{workload.profile}"
    theirs = next(
        (w for w in live_report.workloads if w.profile == workload.profile), None
    )
    if theirs is None:
        return [
            GateOutcome(
                gate,
                "versus_live",
                None,
                None,
                INCONCLUSIVE,
                f"no evidence: live {live_release} did not measure "
                f"{workload.profile!r}",
            )
        ]
    outcomes = []
    if t.max_concurrency_drop_pct is not None:
        outcomes.append(
            _drop(
                gate,
                "max_concurrency_at_slo",
                _knee(workload, t.slo),
                _knee(theirs, t.slo),
                t.max_concurrency_drop_pct,
                "max concurrency at the SLO",
            )
        )
    if t.max_goodput_drop_pct is not None:
        outcomes.append(
            _drop(
                gate,
                "goodput",
                max_goodput(workload),
                max_goodput(theirs),
                t.max_goodput_drop_pct,
                "goodput (requests/s meeting the SLO)",
            )
        )
    if t.max_cost_increase_pct is not None:
        outcomes.append(
            _cost_versus_live(workload, theirs, t, pricing, report, live_report)
        )
    return outcomes


def _cost_versus_live(
    workload: WorkloadReport,
    theirs: WorkloadReport,
    t: Limits,
    pricing: Pricing,
    report: LoadTestReport,
    live_report: LoadTestReport,
) -> GateOutcome:
    gate, metric = f"load:{workload.profile}", "cost_per_1m_output_tokens_vs_live"
    pct = t.max_cost_increase_pct
    mine = unit_costs(workload, t.slo, pricing, report.gpu_count)
    live_costs = unit_costs(theirs, t.slo, pricing, live_report.gpu_count)
    if not pricing.priced:
        return GateOutcome(gate, metric, None, None, INCONCLUSIVE, _unpriced(pricing))
    if live_costs is None or live_costs.cost_per_1m_output_tokens is None:
        return GateOutcome(
            gate,
            metric,
            None,
            None,
            INCONCLUSIVE,
            "no evidence: no load level of live met the SLO, so live has no cost "
            "at the SLO to compare with",
        )
    ceiling = live_costs.cost_per_1m_output_tokens * (1 + decimal_of(pct) / 100)
    if mine is None or mine.cost_per_1m_output_tokens is None:
        return GateOutcome(
            gate,
            metric,
            None,
            float(ceiling),
            FAIL,
            "no load level met the SLO, so it has no cost at the SLO",
        )
    observed = mine.cost_per_1m_output_tokens
    ok = observed <= ceiling
    change = (observed / live_costs.cost_per_1m_output_tokens - 1) * 100
    return GateOutcome(
        gate,
        metric,
        float(observed),
        float(ceiling),
        PASS if ok else FAIL,
        f"{observed} vs live {live_costs.cost_per_1m_output_tokens} "
        f"{pricing.currency} per 1M output tokens: {change:+.1f}% "
        f"({'within' if ok else 'beyond'} the +{pct:g}% allowed)",
    )
