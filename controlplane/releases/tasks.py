"""Celery tasks of the release pipeline: thin wrappers over
controlplane.releases.pipeline, each taking ids or agent messages (never model
objects) and idempotent (each continues from the state recorded now)."""

from celery import shared_task

from controlplane.fleet.models import Deployment
from controlplane.releases import intake, pipeline


@shared_task(name="controlplane.releases.run_promotion")
def run_promotion(release_id: int) -> str:
    """registered -> ... -> awaiting_approval: sends the jobs of the stage the
    release is in (or re-runs its gate); results move it on. Returns its state."""
    return pipeline.advance(release_id)


@shared_task(name="controlplane.releases.run_deployment")
def run_deployment(release_id: int) -> str:
    """approved -> deploying, with the deploy job on an agent (also a rollback's)."""
    return pipeline.deploy(release_id)


@shared_task(name="controlplane.releases.record_job_result")
def record_job_result(result: dict, attempt: int, seal: dict | None = None) -> str:
    """An agent's sealed JobResult (gpuagent.tasks.run_job), checked at the intake
    (unsigned, forged, replayed, stale: refused and audited). A duplicate changes
    nothing."""
    return intake.accept_result(result, attempt, seal)


@shared_task(name="controlplane.releases.record_job_progress")
def record_job_progress(
    job_id: int, attempt: int, agent: str, progress: float, seal: dict | None = None
) -> bool:
    return intake.accept_progress(job_id, attempt, agent, progress, seal)


@shared_task(name="controlplane.releases.watch_jobs")
def watch_jobs() -> dict:
    """Beat: agents that stopped beating go offline and their jobs are retried."""
    return pipeline.watch_jobs()


@shared_task(name="controlplane.releases.run_reverification")
def run_reverification(deployment_id: int) -> str:
    """Send a re-hash of a live deployment's copy to the agent serving it; a
    mismatch marks the deployment failed_verification (rollback button)."""
    return pipeline.reverify(deployment_id)


@shared_task(name="controlplane.releases.reverify_live_deployments")
def reverify_live_deployments() -> int:
    """Periodic (celery beat): queue a re-verification of every live deployment."""
    ids = list(Deployment.objects.filter(state="live").values_list("pk", flat=True))
    for deployment_id in ids:
        run_reverification.delay(deployment_id)
    return len(ids)
