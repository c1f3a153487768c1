"""A release's pipeline as stages with dates and durations, and what the checks cost.

Time to deploy is the machine time of the pipeline: the union of every job's interval
on the way to the first successful deploy (or to now, while it runs). The wait for an
approver is not in it: it measures people, not checks. The integrity share is the
union of the integrity jobs' intervals over that time (inspection, signing, verifying
on another agent); the test share likewise for quality regression and load tests,
which run in parallel, so their union, not their sum, is what they add.
Verify-on-load happens inside the deploy job and is counted there until the agent
reports it apart.
"""

from dataclasses import dataclass
from datetime import datetime

from controlplane.dashboard.health import JobHealth, job_health
from controlplane.releases import evidence
from gpuagent.protocol import JOB_KINDS

INTEGRITY_KINDS = evidence.INTEGRITY_JOB_KINDS
TEST_KINDS = (evidence.QUALITY_JOB_KIND, evidence.LOAD_TEST_JOB_KIND)
AFTER_DEPLOY_KINDS = ("reverify",)


@dataclass(frozen=True)
class Stage:
    job: object
    health: JobHealth
    duration_s: float | None  # a running job: so far

    @property
    def kind(self) -> str:
        return self.job.kind


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


def stages(jobs, now: datetime) -> list[Stage]:
    """Every job of the release in the order they started (queued ones last)."""
    ordered = sorted(jobs, key=lambda j: (j.started is None, j.started or now, j.pk))
    return [Stage(job, job_health(job, now), _duration_s(job, now)) for job in ordered]


def latest_per_kind(jobs, now: datetime) -> list[Stage]:
    """The newest job of each kind, in pipeline order: the per-stage progress of a
    running pipeline."""
    latest = {}
    for job in sorted(jobs, key=lambda j: j.pk):
        latest[job.kind] = job
    order = {kind: position for position, kind in enumerate(JOB_KINDS)}
    kinds = sorted(latest, key=lambda kind: order.get(kind, len(order)))
    return [
        Stage(
            latest[kind], job_health(latest[kind], now), _duration_s(latest[kind], now)
        )
        for kind in kinds
    ]


def overhead(jobs, now: datetime) -> Overhead:
    jobs = [j for j in jobs if j.started and j.kind not in AFTER_DEPLOY_KINDS]
    deploys = [
        j.finished for j in jobs if j.kind == "deploy" and j.state == "succeeded"
    ]
    end = min(deploys) if deploys else now

    def spans(kinds=None) -> list[tuple[datetime, datetime]]:
        return [
            (j.started, min(j.finished or now, end))
            for j in jobs
            if j.started < end and (kinds is None or j.kind in kinds)
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
