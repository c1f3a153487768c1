"""What each pipeline job asks an agent, and how its answer is recorded.

`request_for(job)` builds the JobRequest an agent runs (gpuagent.tasks; a load test
carries its environment's load plan); `record`
writes a JobResult through actions: the job's row, and the state a kind's result
sets (sign: the manifest and signature the approval will bind to). Nothing here
moves a release; that is the pipeline's (controlplane.releases.pipeline)."""

from django.db.models import Q

from controlplane.fleet.backend import job_backend
from controlplane.fleet.models import Agent, Deployment
from controlplane.loadplans.actions import load_plan_for
from controlplane.releases import evidence
from controlplane.releases.actions.jobs import do_finish_job
from controlplane.releases.actions.manifests import do_record_manifest
from controlplane.releases.models import Job, Release
from gpuagent.protocol import (
    BackendSpec,
    HashResult,
    JobRequest,
    JobResult,
    Placement,
    Recipe,
)


def approved_digest(release: Release) -> str:
    """The digest the newest approval is bound to (the release's own without one)."""
    approval = release.approvals.filter(decision="approve").order_by("-id").first()
    return approval.manifest_digest if approval else release.manifest_digest


def deployment_of(job: Job) -> Deployment | None:
    """The deployment a deploy, undeploy or reverify job acts on: the one it was
    sent for; for a job sent without one, the release's newest (deploying for a
    deploy, live for a reverify)."""
    if job.deployment_id is not None:
        return job.deployment
    states = {"deploy": ("deploying",), "reverify": ("live",)}.get(job.kind)
    deployments = job.release.deployments.order_by("-started", "-id")
    if states:
        deployments = deployments.filter(state__in=states)
    return deployments.first()


def quarantined_digests() -> list[str]:
    """Every digest the control plane holds untrusted (a release that failed
    verification or was quarantined), sorted: sent with each deploy job."""
    digests = (
        Release.objects.filter(state__in=evidence.UNTRUSTED_RELEASE_STATES)
        .exclude(manifest_digest="")
        .values_list("manifest_digest", flat=True)
    )
    return sorted(set(digests))


def untrusted_now(release: Release) -> str:
    """Why the digest `release` was approved for is untrusted now ("" while it is
    not): a release holding it failed verification or was quarantined. Locks
    every release holding that digest (and `release`), so no quarantine of one of
    them commits between this check and the caller's commit."""
    digest = approved_digest(release)
    same = Q(pk=release.pk) | (Q(manifest_digest=digest) if digest else Q(pk=None))
    holders = Release.objects.select_for_update().filter(same).order_by("pk")
    untrusted = [r for r in holders if r.state in evidence.UNTRUSTED_RELEASE_STATES]
    if not untrusted:
        return ""
    holder = untrusted[0]
    return (
        f"digest {digest} became untrusted after the deploy was sent "
        f"({holder} is {holder.state})"
    )


def backend_for(job: Job, deployment: Deployment | None = None) -> BackendSpec:
    """The serving backend `job`'s request carries: that of the environment of
    the deployment it acts on (`deployment`, else deployment_of(job)), else of
    its release's target environment."""
    deployment = deployment or (
        deployment_of(job) if job.kind in ("deploy", "undeploy", "reverify") else None
    )
    environment = deployment.environment if deployment else None
    return job_backend((environment or job.release.target_environment).serving_backend)


def request_for(job: Job) -> JobRequest:
    """The request for `job`'s current attempt."""
    release = job.release
    deployment = (
        deployment_of(job) if job.kind in ("deploy", "undeploy", "reverify") else None
    )
    digest = (
        approved_digest(release)
        if job.kind in ("deploy", "reverify")
        else release.manifest_digest
    )
    compressed = evidence.latest_succeeded(release, "compress")
    return JobRequest(
        job_id=job.pk,
        release_id=release.pk,
        kind=job.kind,
        attempt=job.attempts,
        source_uri=release.source_uri,
        recipe=Recipe.model_validate(release.recipe),
        manifest_digest=digest,
        model=release.model.name,
        version=release.version,
        candidate=str(compressed.result.get("candidate", "")) if compressed else "",
        signature=release.signature,
        deployment_id=deployment.pk if deployment else None,
        serving_id=deployment.serving_id if deployment else "",
        backend=backend_for(job, deployment),
        quarantined_digests=quarantined_digests() if job.kind == "deploy" else [],
        load_plan=(
            load_plan_for(release.target_environment)
            if job.kind == "load_test"
            else None
        ),
        placement=(
            Placement.model_validate(deployment.placement)
            if job.kind == "deploy" and deployment and deployment.placement
            else None
        ),
    )


def record(job: Job, result: JobResult, agent: Agent | None) -> Job:
    """Record the answer to `job` (its attempt in force; the caller checked)."""
    release = job.release
    if agent is not None and job.agent_id is None:
        Job.objects.filter(pk=job.pk).update(agent=agent)
        job.agent = agent
    if job.started is None:
        Job.objects.filter(pk=job.pk).update(started=result.started)
        job.started = result.started
    error = result.error or ("" if result.ok else f"{job.kind} failed on the agent")
    if result.ok and job.kind == "sign":
        signed = HashResult.model_validate(result.payload)
        do_record_manifest(
            release,
            manifest_digest=signed.manifest_digest,
            files=signed.files,
            signature=signed.signature,
        )
    return do_finish_job(job, result=result.payload, error=error)
