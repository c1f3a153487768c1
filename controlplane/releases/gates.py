"""Gate evaluation: pure functions, no Django.

`evaluate_policy` holds the evidence a release's jobs produced (the QualityReport of
the evaluate job, the LoadTestReport of the load-test job, whether the integrity
checks passed) against its environment's GatePolicy: one GateOutcome per check, each
pass / fail / inconclusive with what was observed, the threshold and why.
`evaluate_gates` turns outcomes (fresh ones, or GateResult rows) into the release's
decision. Missing evidence is inconclusive, never a pass, and so is no outcome at all.

Default policy (GatePolicy()): every quality slice of gpuagent.protocol.QUALITY_SLICES
and every workload of LOAD_PROFILES must be reported; per slice mean KLD <= 0.03,
same-top-1 >= 0.92, perplexity ratio <= 1.05, flip rate <= 0.25 and the long-context
fact retrieved (the "good 4-bit" grade: lossless KLD <= 0.002 / top-1 >= 0.975 would
fail every int4 recipe); for a MoE candidate, at its worst MoE layer, router
agreement (tokens whose top-k expert set is the parent's) >= 0.6 and expert-load
shift (total variation) <= 0.05, a dense one not subject to them (skipped) and a
report without routing evidence inconclusive; per workload TTFT p99 <= 2000 ms
and TPOT p99 <= 100 ms (the workload's SLO), and against the release live in the
environment max concurrency at the SLO and goodput each down by at most 10%;
sessions, cost and prefix-cache limits off until a team sets them; integrity must
pass, always.

Comparisons with live need a live release: where none is (the first release of an
environment) one "live" outcome says so as `skipped`, which neither passes nor holds
the release, and the absolute gates decide. A live release without a load test is
missing evidence: inconclusive. Money is priced here from the environment's cost
model (controlplane.costs), never from the report's own USD fields.
"""

from decimal import Decimal
from math import floor
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from controlplane.costs.capacity import Slo, unit_costs
from controlplane.costs.money import Pricing
from controlplane.releases import capacity_gates
from controlplane.releases.capacity_gates import LiveBaseline
from controlplane.releases.gate_outcomes import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIPPED,
    GateDecision,
    GateOutcome,
    compare,
    evaluate_gates,
)
from gpuagent.protocol import (
    LOAD_PROFILES,
    QUALITY_SLICES,
    LoadTestReport,
    QualityReport,
    RoutingReport,
    SliceQuality,
    WorkloadReport,
)

# Re-exported: callers take the whole vocabulary of gates from here.
__all__ = [
    "FAIL",
    "INCONCLUSIVE",
    "PASS",
    "SKIPPED",
    "GateDecision",
    "GateOutcome",
    "GatePolicy",
    "LiveBaseline",
    "evaluate_gates",
    "evaluate_policy",
]


class _Policy(BaseModel):
    # Strict: a policy says what it means. 0 is no boolean, "0.03" no number and
    # 16.0 no count; lax coercion would let a typo pass for a setting.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# A slice name the evaluator reports: one of QUALITY_SLICES, or "overall" (all of
# them together). A policy naming another slice could never be met.
QUALITY_SLICE_NAMES = (*QUALITY_SLICES, "overall")


class SliceThresholds(_Policy):
    """Thresholds for one quality slice. A key left out takes its default (inside
    `per_slice`: the policy's `thresholds`); null turns that check off."""

    max_mean_kld: float | None = Field(0.03, ge=0)
    min_same_top1: float | None = Field(0.92, ge=0, le=1)
    max_ppl_ratio: float | None = Field(1.05, gt=0)
    max_flip_rate: float | None = Field(
        0.25, ge=0, le=1, description="flips / continuations compared"
    )


class WorkloadThresholds(_Policy):
    """Thresholds for one workload. A key left out takes its default (inside
    `per_workload`: the policy's `thresholds`); null turns that check off."""

    max_ttft_p99_ms: float | None = Field(2000, gt=0)
    max_tpot_p99_ms: float | None = Field(100, gt=0)
    max_cost_per_1m_output_tokens: float | None = Field(
        None,
        gt=0,
        description="in the currency of the environment's cost model, at the SLO "
        "operating point",
    )
    max_concurrency_drop_pct: float | None = Field(
        10,
        ge=0,
        le=100,
        description="max concurrency at the SLO may be at most this % below live's",
    )
    max_goodput_drop_pct: float | None = Field(
        10,
        ge=0,
        le=100,
        description="the best goodput (requests/s meeting the SLO) may be at most "
        "this % below live's",
    )
    max_cost_increase_pct: float | None = Field(
        None,
        ge=0,
        description="cost per 1M output tokens may be at most this % above live's",
    )
    min_prefix_cache_hit_rate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="session workloads: prefix-cache hits / queries at the SLO "
        "operating point, as the server reported it",
    )

    @property
    def slo(self) -> Slo:
        """The workload's SLO: the latency thresholds (an unset one: unbounded)."""
        return Slo(self.max_ttft_p99_ms, self.max_tpot_p99_ms)

    @property
    def compares_with_live(self) -> bool:
        return any(
            limit is not None
            for limit in (
                self.max_concurrency_drop_pct,
                self.max_goodput_drop_pct,
                self.max_cost_increase_pct,
            )
        )


# A workload's name as a report gives it: one of LOAD_PROFILES or a team's own;
# printable (PostgreSQL's JSON refuses NUL, and a control character hides in logs).
WorkloadName = Annotated[
    str, Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")
]


def _names(values: list[str], what: str, known: tuple[str, ...] = ()) -> list[str]:
    """`values` unless one is repeated or (with `known`) not one of `known`."""
    for index, name in enumerate(values):
        if name in values[:index]:
            raise ValueError(f"{what} {name!r} is named twice")
        if known and name not in known:
            raise ValueError(f"unknown {what} {name!r}; known: {', '.join(known)}")
    return values


def field_error(field: str, message: str, value) -> ValidationError:
    """A check across fields, named by the field it is about, dotted for one
    inside another ("a.b"): a model validator's own ValueError would name the
    whole model."""
    error = PydanticCustomError("value_error", message)
    loc = tuple(field.split("."))
    return ValidationError.from_exception_data(
        "policy", [InitErrorDetails(type=error, loc=loc, input=value)]
    )


def _overrides(entries: dict, base: _Policy) -> dict:
    """`per_slice` / `per_workload` with each entry's unnamed keys taken from the
    policy's `thresholds` (`base`), so an override changes only what it names. A
    null entry is no override."""
    merged = {}
    for name, entry in entries.items():
        if entry is None:
            continue
        inherited = {
            key: getattr(base, key)
            for key in type(base).model_fields
            if key not in entry.model_fields_set
        }
        merged[name] = entry.model_copy(update=inherited)
    return merged


class RoutingThresholds(_Policy):
    """MoE routing of the candidate against its parent on the same tokens (the
    quality report's `routing`), judged at the worst MoE layer. A key left out
    takes its default; null turns that check off. A dense release is not subject
    to it; a MoE release with no routing evidence is inconclusive."""

    min_router_agreement: float | None = Field(
        0.6,
        ge=0,
        le=1,
        description="the worst MoE layer's share of tokens whose top-k expert set "
        "is the parent's",
    )
    max_expert_load_shift: float | None = Field(
        0.05,
        ge=0,
        le=1,
        description="the worst MoE layer's total-variation distance between the "
        "candidate's and the parent's per-expert load shares",
    )
    max_expert_load_change: float | None = Field(
        None,
        ge=0,
        description="the largest change of one expert's load, relative to the "
        "parent's load of it (or to the mean load, where that is larger)",
    )


class QualityPolicy(_Policy):
    slices: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: list(QUALITY_SLICES),
        min_length=1,
        description="slices the report must have (at least one; `quality: null` "
        "stops gating on quality); every reported slice is judged",
    )
    thresholds: SliceThresholds = Field(default_factory=SliceThresholds)
    per_slice: dict[str, SliceThresholds | None] = Field(
        default_factory=dict,
        description="replaces the named keys of `thresholds` for the named slices "
        "(null: no override)",
    )
    require_retrieval: bool = Field(
        True, description="long_context: the planted fact must be retrieved"
    )
    routing: RoutingThresholds | None = Field(
        default_factory=RoutingThresholds,
        description="MoE router agreement and expert-load shift against the parent "
        "(null: not gated on routing)",
    )

    @field_validator("slices")
    @classmethod
    def _known_slices(cls, slices: list[str]) -> list[str]:
        return _names(slices, "slice", QUALITY_SLICE_NAMES)

    @field_validator("per_slice")
    @classmethod
    def _known_override_slices(cls, per_slice: dict) -> dict:
        _names(list(per_slice), "slice", QUALITY_SLICE_NAMES)
        return per_slice

    @model_validator(mode="after")
    def _inherit_thresholds(self) -> "QualityPolicy":
        self.per_slice = _overrides(self.per_slice, self.thresholds)
        return self


class CapacityThreshold(_Policy):
    min_sessions: int = Field(ge=1)
    context_tokens: int = Field(ge=1)


class LoadPolicy(_Policy):
    workloads: list[WorkloadName] = Field(
        default_factory=lambda: list(LOAD_PROFILES),
        description="workloads the report must have (none only with `capacity`; "
        "`load: null` stops gating on load); every reported one is judged",
    )
    thresholds: WorkloadThresholds = Field(default_factory=WorkloadThresholds)
    per_workload: dict[WorkloadName, WorkloadThresholds | None] = Field(
        default_factory=dict,
        description="replaces the named keys of `thresholds` for the named "
        "workloads (null: no override)",
    )
    capacity: CapacityThreshold | None = Field(
        None, description="concurrent sessions the KV budget must hold"
    )

    @field_validator("workloads")
    @classmethod
    def _distinct_workloads(cls, workloads: list[str]) -> list[str]:
        return _names(workloads, "workload")

    def thresholds_of(self, workload: str) -> WorkloadThresholds:
        return self.per_workload.get(workload, self.thresholds)

    @model_validator(mode="after")
    def _inherit_thresholds(self) -> "LoadPolicy":
        if not self.workloads and self.capacity is None:
            # Nothing required and nothing to measure: a gate that passes anything.
            raise field_error(
                "workloads",
                "no workload and no capacity: this load gate checks nothing "
                "(name a workload, set capacity, or set load to null)",
                self.workloads,
            )
        self.per_workload = _overrides(self.per_workload, self.thresholds)
        return self


class GatePolicy(_Policy):
    """An environment's gate policy. `quality` or `load` null: not gated on it.
    Integrity is always gated. `auto_rollback_on_failed_verification`: when a
    live copy fails its periodic re-verification, roll the environment back
    without waiting for an operator (default off)."""

    quality: QualityPolicy | None = Field(default_factory=QualityPolicy)
    load: LoadPolicy | None = Field(default_factory=LoadPolicy)
    auto_rollback_on_failed_verification: bool = False

    def slo_of(self, name: str, workload: WorkloadReport | None) -> Slo:
        """Workload `name`'s SLO: the load policy's latency thresholds for it; with
        `load: null` the SLO the load test itself ran to (the report's), so pages
        still find an operating point."""
        if self.load is not None:
            return self.load.thresholds_of(name).slo
        if workload is None:
            return Slo()
        return Slo(workload.slo_ttft_p99_ms, workload.slo_tpot_p99_ms)


def prices_with_cost_model(policy: GatePolicy) -> bool:
    """Whether a check of `policy` is priced with the environment's cost model (a
    cost limit, or a cost rise over live's, on any workload): a change of the
    model's pricing can then change its outcome."""
    if policy.load is None:
        return False
    return any(
        t.max_cost_per_1m_output_tokens is not None
        or t.max_cost_increase_pct is not None
        for t in (policy.load.thresholds, *policy.load.per_workload.values())
    )


def evaluate_policy(
    policy: GatePolicy,
    quality: QualityReport | None,
    load: LoadTestReport | None,
    integrity_ok: bool | None,
    *,
    live: LiveBaseline | None = None,
    pricing: Pricing | None = None,
) -> list[GateOutcome]:
    """Every check of `policy` against the evidence, integrity first. `live`: the
    release live in the environment (None: nothing is); `pricing`: the
    environment's cost model (None, or a device-hour at 0: cost is no evidence)."""
    outcomes = [_integrity(integrity_ok)]
    if policy.quality is not None:
        outcomes += _quality(policy.quality, quality)
    if policy.load is not None:
        outcomes += _load(policy.load, load, live, pricing)
    return outcomes


# -- integrity ------------------------------------------------------------------------


def _integrity(integrity_ok: bool | None) -> GateOutcome:
    if integrity_ok is None:
        return GateOutcome(
            "integrity", "verified", None, 1, INCONCLUSIVE, "no integrity evidence"
        )
    if not integrity_ok:
        return GateOutcome(
            "integrity", "verified", 0, 1, FAIL, "the integrity checks failed"
        )
    return GateOutcome(
        "integrity", "verified", 1, 1, PASS, "source inspected, candidate verified"
    )


# -- quality --------------------------------------------------------------------------


def _no_report(gate: str, what: str) -> list[GateOutcome]:
    return [
        GateOutcome(gate, "report", None, None, INCONCLUSIVE, f"no evidence: {what}")
    ]


def _indexed(
    entries: list[tuple[str, object]], kind: str, gate: str, required: list[str]
):
    """({name: entry}, outcomes): `entries` is [(name, entry)] from a report; a name
    reported twice, or a required one missing, is an inconclusive outcome."""
    outcomes, by_name = [], {}
    for name, entry in entries:
        if name in by_name:
            outcomes.append(
                GateOutcome(
                    f"{gate}:{name}",
                    "report",
                    None,
                    None,
                    INCONCLUSIVE,
                    f"{kind} {name!r} is reported twice; which one counts?",
                )
            )
        by_name.setdefault(name, entry)
    for name in required:
        if name not in by_name:
            outcomes += _no_report(f"{gate}:{name}", f"{kind} {name!r} is not reported")
    return by_name, outcomes


def _quality(policy: QualityPolicy, report: QualityReport | None) -> list[GateOutcome]:
    if report is None:
        return _no_report("quality", "the evaluate job produced no quality report")
    by_name, outcomes = _indexed(
        [(s.name, s) for s in report.slices], "slice", "quality", policy.slices
    )
    for name, entry in by_name.items():
        thresholds = policy.per_slice.get(name, policy.thresholds)
        outcomes += _slice(entry, thresholds, policy.require_retrieval)
    if policy.routing is not None:
        outcomes += _routing(policy.routing, report.routing)
    return outcomes


ROUTING_GATE = "routing"


def _routing(t: RoutingThresholds, report: RoutingReport | None) -> list[GateOutcome]:
    checks = [
        ("router_agreement", t.min_router_agreement, "min"),
        ("expert_load_shift", t.max_expert_load_shift, "max"),
        ("expert_load_change", t.max_expert_load_change, "max"),
    ]
    checks = [check for check in checks if check[1] is not None]
    if not checks:
        return []
    if report is not None and report.status == "not_applicable":
        # dense: not subject to it. One skipped outcome, so the page says why.
        reason = f"not applicable: {report.reason}"
        return [GateOutcome(ROUTING_GATE, "router", None, None, SKIPPED, reason)]
    if report is None or report.status != "measured":
        why = (
            report.reason
            if report is not None
            else "the quality report doesn't say how the model routes experts "
            "(evaluated before routing was measured)"
        )
        return [
            GateOutcome(
                ROUTING_GATE, metric, None, limit, INCONCLUSIVE, f"no evidence: {why}"
            )
            for metric, limit, _ in checks
        ]
    worst = next(e for e in report.layers if e.layer == report.worst_agreement_layer)
    observed = {
        "router_agreement": (
            report.min_router_agreement,
            report.worst_agreement_layer,
            worst.router_agreement_ci95,
        ),
        "expert_load_shift": (
            report.max_load_shift,
            report.worst_load_shift_layer,
            None,
        ),
        "expert_load_change": (
            report.max_load_change,
            max(report.layers, key=lambda e: e.max_load_change).layer,
            None,
        ),
    }
    outcomes = []
    for metric, limit, bound in checks:
        value, layer, ci95 = observed[metric]
        outcome = compare(ROUTING_GATE, metric, value, limit, bound, ci95=ci95)
        outcomes.append(
            GateOutcome(
                ROUTING_GATE,
                metric,
                value,
                limit,
                outcome.outcome,
                f"{outcome.reason} (worst of {len(report.layers)} MoE layers: "
                f"layer {layer})",
            )
        )
    return outcomes


def _slice(
    entry: SliceQuality, t: SliceThresholds, require_retrieval: bool
) -> list[GateOutcome]:
    gate = f"quality:{entry.name}"
    outcomes = []
    no_tokens = "no evidence: no tokens were evaluated" if not entry.num_tokens else ""
    if t.max_mean_kld is not None:
        outcomes.append(
            compare(
                gate,
                "mean_kld",
                entry.mean_kld,
                t.max_mean_kld,
                "max",
                no_tokens,
                entry.mean_kld_ci95,
            )
        )
    if t.min_same_top1 is not None:
        outcomes.append(
            compare(
                gate,
                "same_top1",
                entry.same_top1,
                t.min_same_top1,
                "min",
                no_tokens,
                entry.same_top1_ci95,
            )
        )
    if t.max_ppl_ratio is not None:
        outcomes.append(
            compare(
                gate, "ppl_ratio", entry.ppl_ratio, t.max_ppl_ratio, "max", no_tokens
            )
        )
    if t.max_flip_rate is not None:
        if entry.num_continuations:
            rate = entry.flips / entry.num_continuations
            outcomes.append(compare(gate, "flip_rate", rate, t.max_flip_rate, "max"))
        else:
            outcomes.append(
                GateOutcome(
                    gate,
                    "flip_rate",
                    None,
                    t.max_flip_rate,
                    INCONCLUSIVE,
                    "no evidence: no continuations were compared",
                )
            )
    if require_retrieval and entry.name == "long_context":
        if entry.retrieval_ok is None:
            outcomes.append(
                GateOutcome(
                    gate,
                    "retrieval",
                    None,
                    1,
                    INCONCLUSIVE,
                    "no evidence: retrieval of the planted fact was not measured",
                )
            )
        else:
            ok = entry.retrieval_ok
            outcomes.append(
                GateOutcome(
                    gate,
                    "retrieval",
                    float(ok),
                    1,
                    PASS if ok else FAIL,
                    "the planted fact was retrieved"
                    if ok
                    else "the planted fact was not retrieved",
                )
            )
    return outcomes


# -- load -----------------------------------------------------------------------------


def _load(
    policy: LoadPolicy,
    report: LoadTestReport | None,
    live: LiveBaseline | None,
    pricing: Pricing | None,
) -> list[GateOutcome]:
    if report is None:
        return _no_report("load", "the load-test job produced no report")
    by_profile, outcomes = _indexed(
        [(w.profile, w) for w in report.workloads], "workload", "load", policy.workloads
    )
    pricing = pricing or Pricing("USD", Decimal(0))
    comparing = any(policy.thresholds_of(p).compares_with_live for p in by_profile)
    live_report, outcomes_of_baseline = capacity_gates.baseline(live, comparing)
    outcomes += outcomes_of_baseline
    for profile, workload in by_profile.items():
        thresholds = policy.thresholds_of(profile)
        outcomes += _workload(workload, thresholds, pricing, report.gpu_count)
        if live_report is not None and thresholds.compares_with_live:
            outcomes += capacity_gates.versus_live(
                workload, thresholds, pricing, report, live_report, live.release
            )
    if policy.capacity is not None:
        outcomes.append(_capacity(policy.capacity, report))
    return outcomes


def _workload(
    workload: WorkloadReport,
    t: WorkloadThresholds,
    pricing: Pricing,
    measured_devices: int,
) -> list[GateOutcome]:
    gate = f"load:{workload.profile}"
    valid = [run for run in workload.runs if run.valid]
    if not valid:
        why = (
            "no evidence: the load client fell behind its schedule in every run"
            if workload.runs
            else "no evidence: no load runs"
        )
        checks = (
            ("ttft_p99_ms", t.max_ttft_p99_ms),
            ("tpot_p99_ms", t.max_tpot_p99_ms),
            ("cost_per_1m_output_tokens", t.max_cost_per_1m_output_tokens),
            ("prefix_cache_hit_rate", t.min_prefix_cache_hit_rate),
        )
        return [
            GateOutcome(gate, metric, None, limit, INCONCLUSIVE, why)
            for metric, limit in checks
            if limit is not None
        ]
    outcomes = []
    for metric, headline, per_run, limit in (
        (
            "ttft_p99_ms",
            workload.ttft_p99_ms,
            [r.ttft_ms.p99 for r in valid],
            t.max_ttft_p99_ms,
        ),
        (
            "tpot_p99_ms",
            workload.tpot_p99_ms,
            [r.tpot_ms.p99 for r in valid],
            t.max_tpot_p99_ms,
        ),
    ):
        if limit is None:
            continue
        if headline is not None:
            outcomes.append(compare(gate, metric, headline, limit, "max"))
        else:
            # No load met the workload's SLO: judge the lightest load's number.
            best = min(per_run)
            outcome = compare(gate, metric, best, limit, "max")
            outcomes.append(
                GateOutcome(
                    gate,
                    metric,
                    best,
                    limit,
                    outcome.outcome,
                    f"{outcome.reason} (no load level met the SLO; best run)",
                )
            )
    costs = unit_costs(workload, t.slo, pricing, measured_devices)
    limit = t.max_cost_per_1m_output_tokens
    if limit is not None:
        metric = "cost_per_1m_output_tokens"
        outcomes.append(capacity_gates.cost(gate, costs, limit, pricing, metric))
    if t.min_prefix_cache_hit_rate is not None:
        minimum = t.min_prefix_cache_hit_rate
        outcomes.append(capacity_gates.hit_rate(gate, costs, minimum))
    return outcomes


def _capacity(policy: CapacityThreshold, report: LoadTestReport) -> GateOutcome:
    metric = f"sessions_at_{policy.context_tokens}_tokens"
    matching = [
        w.max_sessions_at_context
        for w in report.workloads
        if w.context_tokens == policy.context_tokens
    ]
    if matching:
        sessions = max(matching)
        source = "measured by a workload of that context"
    elif report.kv_bytes_per_token:
        per_session = report.kv_bytes_per_token * policy.context_tokens
        sessions = floor(report.kv_budget_bytes / per_session)
        source = "KV budget / (KV bytes per token x context)"
    else:
        return GateOutcome(
            "capacity",
            metric,
            None,
            policy.min_sessions,
            INCONCLUSIVE,
            "no evidence: the report has no KV bytes per token",
        )
    outcome = compare("capacity", metric, sessions, policy.min_sessions, "min")
    return GateOutcome(
        "capacity",
        metric,
        sessions,
        policy.min_sessions,
        outcome.outcome,
        f"{outcome.reason} ({source})",
    )
