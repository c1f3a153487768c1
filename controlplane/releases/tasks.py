"""Celery tasks of the promotion pipeline. Thin: each takes ids, re-reads the rows,
and does its writes through actions.py. Each is idempotent: it continues from the
state the release is in now, so a redelivered or repeated task does no harm.

A repeated task that reaches a stage whose job another worker still runs (its lease
is live: JobLeaseHeld) steps aside and returns BUSY, changing nothing; once that
lease has expired (the worker died), the next run resumes the job. While a stage
works, a heartbeat thread renews its job's lease, so a stage longer than one lease
(hashing a big model) keeps it."""

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from celery import shared_task
from django.conf import settings
from django.db import connection, transaction

from controlplane.audit.models import AuditEvent
from controlplane.errors import IllegalTransition, JobLeaseHeld
from controlplane.fleet.models import Deployment
from controlplane.releases import actions, stages
from controlplane.releases.gates import evaluate_gates
from controlplane.releases.models import Job, Release

log = logging.getLogger(__name__)
WORKER = "system:worker"
# What a task returns when another worker holds the job it would run.
BUSY = "busy"

# state the release is in while its jobs run -> (jobs in order, next state).
# Each job's `work(release)` returns (result dict, error message or "").
PIPELINE = {
    "verifying": ((("verify_source", stages.verify_source),), "compressing"),
    "compressing": (
        (("compress", stages.compress), ("sign", stages.sign)),
        "evaluating",
    ),
    "evaluating": ((("evaluate", stages.evaluate),), "gated"),
}
FAILURE_STATE = {"verify_source": "failed_verification"}


def _entered(release: Release) -> datetime:
    """When the release last moved into its current state."""
    event = (
        AuditEvent.objects.filter(
            verb="release.transition",
            object_type="release",
            object_id=str(release.pk),
            after__state=release.state,
        )
        .order_by("-created", "-id")
        .first()
    )
    return event.created if event else release.created


def _log_busy(held: JobLeaseHeld, release_id: int) -> str:
    log.info("release %s: %s; leaving it to its worker", release_id, held.message)
    return BUSY


@contextmanager
def _finishing(job: Job) -> Iterator[None]:
    """One transaction for a job's finish and the move it causes. If another run
    moved the release first (IllegalTransition), the rollback took the finish with
    it: close the job as superseded (its outcome no longer counts) so that it doesn't
    sit `running` under a lease and hold the stage, then re-raise."""
    try:
        with transaction.atomic():
            yield
    except IllegalTransition:
        actions.do_finish_job(job, error="superseded: another run moved the release on")
        raise


@contextmanager
def _heartbeat(job: Job) -> Iterator[None]:
    """Renew `job`'s lease every third of a lease while the block runs, from a
    thread with its own database connection (closed when it stops)."""
    stop = threading.Event()
    interval = settings.RELEASEGATE_JOB_LEASE_S / 3

    def beat() -> None:
        try:
            while not stop.wait(interval):
                if not actions.do_renew_job_lease(job):
                    return  # finished or taken over: nothing left to hold
        except Exception:  # a missed beat only shortens the lease; never the stage
            log.exception("heartbeat of job %s stopped", job.pk)
        finally:
            connection.close()

    thread = threading.Thread(target=beat, name=f"heartbeat-job-{job.pk}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _work_of(job: Job, what: str, work, *args) -> tuple[dict, str]:
    """`work(*args)` under `job`'s heartbeat. A crash (a bug, an unreachable source)
    becomes its error, so the release moves to a failure state it can leave
    instead of staying in the stage."""
    try:
        with _heartbeat(job):
            return work(*args)
    except Exception as exc:
        log.exception("%s failed for release %s", what, job.release_id)
        return {}, f"{type(exc).__name__}: {exc}"


def _run_stage(release: Release) -> bool:
    """Run the jobs of the release's current state; True when it moved on. Raises
    JobLeaseHeld, without running it, when another worker runs the next job."""
    jobs, next_state = PIPELINE[release.state]
    entered = _entered(release)
    for position, (kind, work) in enumerate(jobs):
        last = position == len(jobs) - 1
        if (
            not last
            and release.jobs.filter(
                kind=kind, state="succeeded", finished__gte=entered
            ).exists()
        ):
            continue  # done in this pass before a redelivery
        job = actions.do_start_job(release, kind)
        result, error = _work_of(job, f"stage {kind}", work, release)
        # The last job's finish and the move on commit together: a release still in
        # this state never has all of this pass's jobs succeeded.
        with _finishing(job):
            actions.do_finish_job(job, result=result, error=error)
            if error:
                to_state = FAILURE_STATE.get(kind, "failed")
                actions.do_transition_release(
                    release, to_state, actor=WORKER, reason=f"{kind}: {error}"
                )
                return False
            if last:
                actions.do_transition_release(release, next_state, actor=WORKER)
    return True


def _run_gate(release: Release) -> bool:
    job = actions.do_start_job(release, "gate")
    decision = evaluate_gates(release.gate_results.all())
    result = {"outcome": decision.outcome, "reason": decision.reason}
    with _finishing(job):
        if decision.outcome == "inconclusive":
            # Pause in gated: a person looks, or later evidence re-runs the gate.
            actions.do_finish_job(job, result=result)
            return False
        actions.do_finish_job(
            job, result=result, error="" if decision.ok else decision.reason
        )
        if decision.ok:
            actions.do_transition_release(release, "awaiting_approval", actor=WORKER)
        else:
            actions.do_transition_release(
                release, "failed", actor=WORKER, reason=decision.reason
            )
    return decision.ok


@shared_task(name="controlplane.releases.run_promotion")
def run_promotion(release_id: int) -> str:
    """registered -> verifying -> compressing -> evaluating -> gated ->
    awaiting_approval, running each stage's work; stops there for a person.
    Returns the release's state, or BUSY (nothing done) when another worker holds
    the job of the stage the release is in."""
    release = Release.objects.filter(pk=release_id).first()
    if release is None:
        return "missing"
    try:
        if release.state == "registered":
            actions.do_transition_release(release, "verifying", actor=WORKER)
        while release.state in PIPELINE:
            if not _run_stage(release):
                break
        if release.state == "gated":
            _run_gate(release)
    except JobLeaseHeld as held:
        return _log_busy(held, release_id)
    except IllegalTransition:
        # Another run of this task moved the release meanwhile; it carries on.
        release.refresh_from_db()
        log.info("release %s moved concurrently; now %s", release_id, release.state)
    return release.state


@shared_task(name="controlplane.releases.run_deployment")
def run_deployment(release_id: int) -> str:
    """approved -> deploying -> live; whatever was live in the environment becomes
    superseded. Also finishes a rollback (release already deploying). Returns the
    release's state, or BUSY (nothing done) when another worker holds its deploy
    job."""
    release = Release.objects.filter(pk=release_id).first()
    if release is None:
        return "missing"
    try:
        if release.state == "approved":
            actions.do_start_deployment(release, actor=WORKER)
        if release.state != "deploying":
            return release.state
        deployment = (
            Deployment.objects.filter(release=release, state="deploying")
            .order_by("-started", "-id")
            .first()
        )
        if deployment is None:
            deployment = actions.do_start_deployment(
                release, actor=WORKER, environment=release.target_environment
            )
        job = actions.do_start_job(release, "deploy")
        # A crash fails the deployment: promote retries a failed release, while
        # nothing would move a deploying one on.
        result, error = _work_of(job, "deploy", stages.deploy, release, deployment)
        with _finishing(job):
            actions.do_finish_job(job, result=result, error=error)
            if error:
                actions.do_fail_deployment(deployment, actor=WORKER, reason=error)
            else:
                actions.do_complete_deployment(
                    deployment, actor=WORKER, endpoint=result.get("endpoint", "")
                )
    except JobLeaseHeld as held:
        return _log_busy(held, release_id)
    except IllegalTransition:
        log.info("release %s moved concurrently", release_id)
    release.refresh_from_db(fields=["state"])
    return release.state


@shared_task(name="controlplane.releases.run_reverification")
def run_reverification(deployment_id: int) -> str:
    """Re-hash a live deployment's files; a mismatch marks the deployment (and its
    release) failed_verification, which puts the rollback button on the dashboard.
    Returns the deployment's state, or BUSY (nothing done) when another worker holds
    the release's reverify job (a re-hash longer than the beat interval)."""
    deployment = (
        Deployment.objects.filter(pk=deployment_id).select_related("release").first()
    )
    if deployment is None:
        return "missing"
    if deployment.state != "live":
        return deployment.state
    release = deployment.release
    try:
        job = actions.do_start_job(release, "reverify")
    except JobLeaseHeld as held:
        return _log_busy(held, release.pk)
    try:
        with _heartbeat(job):
            result, error = stages.reverify(release)
    except Exception as exc:
        # Close the job (no lease left holding it); the deployment stays as it is:
        # a re-hash that could not run says nothing about the files.
        log.exception("reverify crashed for deployment %s", deployment_id)
        actions.do_finish_job(job, error=f"{type(exc).__name__}: {exc}")
        return deployment.state
    try:
        with _finishing(job):
            actions.do_finish_job(job, result=result, error=error)
            if error:
                actions.do_fail_deployment(
                    deployment, actor=WORKER, reason=error, verification=True
                )
    except IllegalTransition:
        pass  # the deployment stopped being live (superseded, rolled back) meanwhile
    deployment.refresh_from_db(fields=["state"])
    return deployment.state


@shared_task(name="controlplane.releases.reverify_live_deployments")
def reverify_live_deployments() -> int:
    """Periodic (celery beat): queue a re-verification of every live deployment."""
    ids = list(Deployment.objects.filter(state="live").values_list("pk", flat=True))
    for deployment_id in ids:
        run_reverification.delay(deployment_id)
    return len(ids)
