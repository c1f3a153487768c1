"""A release's pipeline as stages with dates and durations, and what the checks cost.

Time to deploy is the machine time of the pipeline: the union of every job's interval
on the way to the first successful deploy (or to now, while it runs). The wait for an
approver is not in it: it measures people, not checks. The integrity share is the
union of the integrity jobs' intervals over that time (inspection, signing, verifying
on another agent); the test share likewise for quality regression and load tests,
which run in parallel, so their union, not their sum, is what they add.
Verify-on-load happens inside the deploy job and is counted there until the agent
reports it apart. A job that did no work (its result says `{"skipped": why}`) took
time but checked nothing, so it counts in the time to deploy and in no check's share.

What a stage shows is its outcome, not only its job's state: a job that skipped its
work is "skipped" with why, never "succeeded"; the gate stage shows pass, fail or
inconclusive as the recorded gate results say (gates.evaluate_gates, the pipeline's
own rule), since its job "succeeds" whenever it got as far as deciding.
"""

from dataclasses import dataclass
from datetime import datetime

from controlplane.dashboard.health import JobHealth, job_health
from controlplane.releases import evidence
from controlplane.releases.gates import evaluate_gates
from controlplane.releases.models import GATE_OUTCOMES
from gpuagent.protocol import JOB_KINDS

INTEGRITY_KINDS = evidence.INTEGRITY_JOB_KINDS
TEST_KINDS = (evidence.QUALITY_JOB_KIND, evidence.LOAD_TEST_JOB_KIND)
AFTER_DEPLOY_KINDS = ("reverify",)
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

    @property
    def kind(self) -> str:
        return self.job.kind


def skipped_reason(job) -> str | None:
    """Why `job` did no work, or None when it did (or has not finished)."""
    result = job.result if isinstance(job.result, dict) else {}
    if job.state != "succeeded" or "skipped" not in result:
        return None
    return str(result["skipped"] or "no reason given")


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


def _stage(job, now: datetime, gate_results, newest_gate_pk) -> Stage:
    return Stage(
        job,
        job_health(job, now),
        _duration_s(job, now),
        outcome(job, gate_results, newest_gate=job.pk == newest_gate_pk),
    )


def _newest_gate_pk(jobs) -> int | None:
    gates = [j for j in jobs if j.kind == GATE_JOB_KIND]
    return max(gates, key=lambda j: j.pk).pk if gates else None


@dataclass(frozen=True)
class Overhead:
    time_to_deploy_s: float
    integrity_s: float
    tests_s: float
    deployed: bool

    @property
    def integrity_share(self) -> float | None:
        return (
            self.integrity_s / self.time_to_deploy_s if self.time_to_deploy_s else None
        )

    @property
    def tests_share(self) -> float | None:
        return self.tests_s / self.time_to_deploy_s if self.time_to_deploy_s else None


def stages(jobs, now: datetime, gate_results=None) -> list[Stage]:
    """Every job of the release in the order they started (queued ones last)."""
    jobs = list(jobs)
    newest_gate = _newest_gate_pk(jobs)
    ordered = sorted(jobs, key=lambda j: (j.started is None, j.started or now, j.pk))
    return [_stage(job, now, gate_results, newest_gate) for job in ordered]


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


def overhead(jobs, now: datetime) -> Overhead:
    jobs = [j for j in jobs if j.started and j.kind not in AFTER_DEPLOY_KINDS]
    deploys = [
        j.finished for j in jobs if j.kind == "deploy" and j.state == "succeeded"
    ]
    end = min(deploys) if deploys else now

    def spans(kinds=None) -> list[tuple[datetime, datetime]]:
        # A check that skipped its work added no checking, only time to deploy.
        return [
            (j.started, min(j.finished or now, end))
            for j in jobs
            if j.started < end
            and (kinds is None or (j.kind in kinds and skipped_reason(j) is None))
        ]

    return Overhead(
        time_to_deploy_s=_union_s(spans()),
        integrity_s=_union_s(spans(INTEGRITY_KINDS)),
        tests_s=_union_s(spans(TEST_KINDS)),
        deployed=bool(deploys),
    )


def _duration_s(job, now: datetime) -> float | None:
    if job.started is None:
        return None
    return ((job.finished or now) - job.started).total_seconds()


def _union_s(spans: list[tuple[datetime, datetime]]) -> float:
    """Seconds covered by at least one of `spans` (overlaps counted once)."""
    total = 0.0
    current_start = current_end = None
    for start, end in sorted(spans):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += (current_end - current_start).total_seconds()
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += (current_end - current_start).total_seconds()
    return total
