"""A release's pipeline as stages with dates and durations. What the checks cost
(time to deploy, integrity and test shares) is controlplane.releases.timings, one
definition shared with the API.

What a stage shows is its outcome, not only its job's state: a job that skipped its
work is "skipped" with why, never "succeeded"; the gate stage shows pass, fail or
inconclusive as the recorded gate results say (gates.evaluate_gates, the pipeline's
own rule), since its job "succeeds" whenever it got as far as deciding.
"""

from dataclasses import dataclass
from datetime import datetime

from controlplane.dashboard.health import JobHealth, job_health
from controlplane.releases.evidence import Reverifications
from controlplane.releases.gates import evaluate_gates
from controlplane.releases.models import AFTER_DEPLOY_JOB_KINDS, GATE_OUTCOMES
from controlplane.releases.timings import skipped_reason
from gpuagent.protocol import JOB_KINDS

GATE_JOB_KIND = "gate"
FINISHED_JOB_STATES = ("succeeded", "failed")


@dataclass(frozen=True)
class Outcome:
    label: str  # a job state, "skipped", or a gate outcome (pass/fail/inconclusive)
    reason: str = ""


@dataclass(frozen=True)
class Stage:
    job: object
    health: JobHealth
    duration_s: float | None  # a running job: so far
    outcome: Outcome
    # How many jobs of its kind the row stands for: a live copy's periodic
    # re-verifications are one row, the newest, however many ran.
    runs: int = 1

    @property
    def kind(self) -> str:
        return self.job.kind

    @property
    def periodic(self) -> bool:
        """A check of the live copy, repeated every interval (not a pipeline stage)."""
        return self.job.kind in AFTER_DEPLOY_JOB_KINDS


def outcome(job, gate_results=None, *, newest_gate: bool = True) -> Outcome:
    """What `job` came to. `gate_results` are the release's recorded GateResults;
    they decide the newest gate job. An older gate job shows the outcome its result
    recorded; without one it is inconclusive: no evidence is never a pass."""
    why_skipped = skipped_reason(job)
    if why_skipped is not None:
        return Outcome("skipped", why_skipped)
    if job.kind != GATE_JOB_KIND or job.state not in FINISHED_JOB_STATES:
        return Outcome(job.state, job.error if job.state == "failed" else "")
    if newest_gate and gate_results is not None:
        decision = evaluate_gates(gate_results)
        return Outcome(decision.outcome, decision.reason)
    result = job.result if isinstance(job.result, dict) else {}
    if result.get("outcome") in GATE_OUTCOMES:
        return Outcome(result["outcome"], str(result.get("reason") or job.error))
    return Outcome("inconclusive", job.error or "no gate outcome recorded")


def _stage(job, now: datetime, gate_results, newest_gate_pk, runs: int = 1) -> Stage:
    return Stage(
        job,
        job_health(job, now),
        _duration_s(job, now),
        outcome(job, gate_results, newest_gate=job.pk == newest_gate_pk),
        runs,
    )


def _newest_gate_pk(jobs) -> int | None:
    gates = [j for j in jobs if j.kind == GATE_JOB_KIND]
    return max(gates, key=lambda j: j.pk).pk if gates else None


def stages(
    jobs, now: datetime, gate_results=None, reverified: Reverifications | None = None
) -> list[Stage]:
    """Every job of the release's pipeline in the order they started (queued ones
    last). The re-verifications of a live copy, one per interval without end, are
    no stage: they are one row, the newest of `reverified`, with how many ran."""
    jobs = [job for job in jobs if job.kind not in AFTER_DEPLOY_JOB_KINDS]
    newest_gate = _newest_gate_pk(jobs)
    ordered = sorted(jobs, key=lambda j: (j.started is None, j.started or now, j.pk))
    rows = [_stage(job, now, gate_results, newest_gate) for job in ordered]
    if reverified is not None and reverified.newest is not None:
        rows.append(_stage(reverified.newest, now, None, None, reverified.count))
    return rows


def latest_per_kind(jobs, now: datetime, gate_results=None) -> list[Stage]:
    """The newest job of each kind, in pipeline order: the per-stage progress of a
    running pipeline."""
    latest = {}
    for job in sorted(jobs, key=lambda j: j.pk):
        latest[job.kind] = job
    newest_gate = _newest_gate_pk(latest.values())
    order = {kind: position for position, kind in enumerate(JOB_KINDS)}
    kinds = sorted(latest, key=lambda kind: order.get(kind, len(order)))
    return [_stage(latest[kind], now, gate_results, newest_gate) for kind in kinds]


def paused_at_gate(jobs) -> bool:
    """Whether the pipeline has finished its gate stage and waits for a person (or
    for new evidence): nothing of it is running any more."""
    gate = _newest_gate_pk(jobs)
    return gate is not None and any(
        j.pk == gate and j.state in FINISHED_JOB_STATES for j in jobs
    )


def _duration_s(job, now: datetime) -> float | None:
    if job.started is None:
        return None
    return ((job.finished or now) - job.started).total_seconds()
