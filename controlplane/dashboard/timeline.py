"""A release's pipeline as stages with dates and durations (what the checks cost
is controlplane.releases.timings, shared with the API)."""

from dataclasses import dataclass
from datetime import datetime

from controlplane.dashboard.health import JobHealth, job_health
from gpuagent.protocol import JOB_KINDS


@dataclass(frozen=True)
class Stage:
    job: object
    health: JobHealth
    duration_s: float | None  # a running job: so far

    @property
    def kind(self) -> str:
        return self.job.kind


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


def _duration_s(job, now: datetime) -> float | None:
    if job.started is None:
        return None
    return ((job.finished or now) - job.started).total_seconds()
