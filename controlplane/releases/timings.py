"""What the checks cost: every stage's start and end for a release's latest pass
through the pipeline, and how much of the time to deploy went to integrity checks
and to quality/load tests (seconds, and percent of the time to deploy).

Time to deploy is the time the pipeline worked on the release: from its first job
(the source inspection) to the gate's decision, plus from the deploy job's dispatch
to its result. The wait for a person's approval is not in it."""

from datetime import datetime

from controlplane.audit.models import AuditEvent
from controlplane.releases.models import Job, Release

INTEGRITY_KINDS = ("verify_source", "inspect", "sign", "verify")
QUALITY_LOAD_KINDS = ("evaluate", "load_test")


def _pass_start(release: Release) -> datetime | None:
    """When the release last entered verifying (the start of its latest pass)."""
    return (
        AuditEvent.objects.filter(
            verb="release.transition",
            object_type="release",
            object_id=str(release.pk),
            after__state="verifying",
        )
        .order_by("-created", "-id")
        .values_list("created", flat=True)
        .first()
    )


def _union_s(intervals: list[tuple[datetime, datetime]]) -> float:
    """Seconds covered by the intervals (parallel jobs count once)."""
    total, end = 0.0, None
    for start, finish in sorted(intervals):
        if end is not None and start < end:
            start = end
        if finish > start:
            total += (finish - start).total_seconds()
            end = finish if end is None else max(end, finish)
    return total


def _interval(job: Job) -> tuple[datetime, datetime] | None:
    start = job.started or job.created
    return (start, job.finished) if job.finished else None


def stage_timings(release: Release) -> dict:
    """{"stages": [...], "time_to_deploy_s", "integrity_s", "integrity_pct",
    "quality_load_s", "quality_load_pct"}; the numbers are None until the
    pipeline has decided its gate."""
    since = _pass_start(release)
    jobs = release.jobs.select_related("agent").order_by("created", "id")
    if since is not None:
        jobs = jobs.filter(created__gte=since)
    jobs = list(jobs)
    stages = [
        {
            "kind": job.kind,
            "state": job.state,
            "agent": job.agent.name if job.agent else None,
            "attempts": job.attempts,
            "queued": job.created.isoformat(),
            "started": job.started.isoformat() if job.started else None,
            "finished": job.finished.isoformat() if job.finished else None,
            "duration_s": job.duration_s,
        }
        for job in jobs
    ]
    result = {
        "stages": stages,
        "time_to_deploy_s": None,
        "integrity_s": None,
        "integrity_pct": None,
        "quality_load_s": None,
        "quality_load_pct": None,
    }
    gate = [j for j in jobs if j.kind == "gate" and j.finished]
    if not jobs or not gate:
        return result
    total = (gate[-1].finished - jobs[0].created).total_seconds()
    deploys = [j for j in jobs if j.kind == "deploy" and j.finished]
    if deploys:
        total += (deploys[-1].finished - deploys[-1].created).total_seconds()

    def share(kinds: tuple[str, ...]) -> tuple[float, float | None]:
        spans = [i for j in jobs if j.kind in kinds and (i := _interval(j))]
        seconds = round(_union_s(spans), 3)
        return seconds, (round(100 * seconds / total, 1) if total > 0 else None)

    result["time_to_deploy_s"] = round(total, 3)
    result["integrity_s"], result["integrity_pct"] = share(INTEGRITY_KINDS)
    result["quality_load_s"], result["quality_load_pct"] = share(QUALITY_LOAD_KINDS)
    return result
