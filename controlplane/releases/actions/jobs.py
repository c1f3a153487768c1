"""Jobs: dispatched, leased, retried, finished."""

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.audit.actions import do_record_event
from controlplane.errors import (
    JobLeaseHeld,
    ValidationFailed,
)
from controlplane.fleet.models import Agent, Deployment
from controlplane.releases.models import (
    JOB_STATES,
    Job,
    Release,
)
from controlplane.releases.sources import relative_to_source
from gpuagent.protocol import JOB_KINDS


def _lease_until(now: datetime) -> datetime:
    return now + timedelta(seconds=settings.RELEASEGATE_JOB_LEASE_S)


def do_start_job(release: Release, kind: str, *, agent: Agent | None = None) -> Job:
    """Start a stage's job, leased to the caller for RELEASEGATE_JOB_LEASE_S. A job
    of the same kind still queued, or running with an expired lease (its worker
    died), is resumed with attempts + 1 instead of adding another row. One running
    under a live lease raises JobLeaseHeld and is left as it is: its worker is
    still at it, and a second run of the same work must not start."""
    if kind not in JOB_KINDS:
        raise ValidationFailed(f"unknown job kind {kind!r}", field="kind")
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .filter(release=release, kind=kind, state__in=("queued", "running"))
            .order_by("-id")
            .first()
        )
        now = timezone.now()
        if job is None:
            job = Job(release=release, kind=kind)
        elif job.state == "running" and job.lease_expires and job.lease_expires > now:
            raise JobLeaseHeld(job.pk, kind, job.lease_expires)
        job.state = "running"
        job.agent = agent or job.agent
        job.attempts += 1
        job.progress = 0.0
        job.started = now
        job.finished = None
        job.lease_expires = _lease_until(now)
        job.error = ""
        job.save()
    return job


def do_dispatch_job(
    release: Release, kind: str, *, deployment: Deployment | None = None
) -> Job:
    """A new job for an agent, queued (attempt 1), about `deployment` where it acts
    on one (deploy, reverify); the caller sends its request."""
    if kind not in JOB_KINDS:
        raise ValidationFailed(f"unknown job kind {kind!r}", field="kind")
    # Until when an agent must have taken it (pipeline.watch_jobs retries it then).
    deadline = timezone.now() + timedelta(
        seconds=settings.RELEASEGATE_JOB_QUEUE_TIMEOUT_S
    )
    return Job.objects.create(
        release=release,
        kind=kind,
        state="queued",
        attempts=1,
        lease_expires=deadline,
        deployment=deployment,
    )


def do_mark_job_running(job: Job, *, attempt: int, agent: Agent, progress: float):
    """An agent reports it runs `attempt` of `job` (progress in 0..1). False, and
    nothing changed, for a finished job or an attempt no longer in force."""
    progress = min(max(progress, 0.0), 1.0)
    now = timezone.now()
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.state not in ("queued", "running") or locked.attempts != attempt:
            return False
        if locked.state == "queued":  # taken now: the time limit starts
            locked.started = now
            locked.lease_expires = now + timedelta(
                seconds=settings.RELEASEGATE_JOB_TIME_LIMIT_S
            )
        locked.state = "running"
        locked.agent = agent
        locked.progress = progress
        locked.save(
            update_fields=["state", "agent", "progress", "started", "lease_expires"]
        )
    return True


def do_retry_job(job: Job, *, reason: str) -> Job:
    """Send `job` again (attempt + 1) after its agent went silent: the result of
    the earlier attempt, should it still come, no longer counts."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        before = locked.to_dict()
        locked.attempts += 1
        locked.state = "queued"
        locked.agent = None
        locked.progress = 0.0
        locked.started = None
        locked.lease_expires = timezone.now() + timedelta(
            seconds=settings.RELEASEGATE_JOB_QUEUE_TIMEOUT_S
        )
        locked.error = reason
        locked.save()
        do_record_event(
            "system:worker",
            "job.retried",
            locked,
            before={"attempts": before["attempts"], "agent": before["agent"]},
            after={"attempts": locked.attempts, "reason": reason},
            team=locked.release.team,
        )
    job.refresh_from_db()
    return job


def do_update_job_progress(job: Job, progress: float) -> Job:
    """Record progress; for a running job this is also the heartbeat that extends
    its lease, so a stage longer than one lease keeps its job."""
    if not 0.0 <= progress <= 1.0:
        raise ValidationFailed("progress must be within 0..1", field="progress")
    if not _renew_lease(job, progress=progress):  # queued or finished: no lease
        Job.objects.filter(pk=job.pk).update(progress=progress)
    job.progress = progress
    return job


def do_renew_job_lease(job: Job) -> bool:
    """Extend a running job's lease by RELEASEGATE_JOB_LEASE_S from now (the
    heartbeat of a stage at work); False when the job is no longer running."""
    return _renew_lease(job)


def _renew_lease(job: Job, **fields) -> bool:
    """One UPDATE of a running job: its lease from now, plus `fields`."""
    lease_expires = _lease_until(timezone.now())
    renewed = Job.objects.filter(pk=job.pk, state="running").update(
        lease_expires=lease_expires, **fields
    )
    if renewed:
        job.lease_expires = lease_expires
    return bool(renewed)


def do_finish_job(job: Job, *, result: dict | None = None, error: str = "") -> Job:
    """Close a job: succeeded without `error`, failed with it."""
    state = "failed" if error else "succeeded"
    assert state in JOB_STATES
    with transaction.atomic():
        job.state = state
        job.finished = timezone.now()
        job.progress = 1.0 if state == "succeeded" else job.progress
        job.lease_expires = None
        job.result = relative_to_source(result or {}, job.release.source_uri)
        job.error = relative_to_source(error, job.release.source_uri)
        job.save(
            update_fields=[
                "state",
                "finished",
                "progress",
                "lease_expires",
                "result",
                "error",
            ]
        )
        do_record_event(
            "system:worker",
            f"job.{state}",
            job,
            after={"kind": job.kind, "duration_s": job.duration_s, "error": error},
            team=job.release.team,
        )
    return job
