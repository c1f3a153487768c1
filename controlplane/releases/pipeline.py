"""The promotion and deployment pipeline: which jobs each release state runs, on
which agent, and where the release goes once they have answered.

Agents do the work (gpuagent.tasks, by task name on their queues); this module
dispatches their jobs through the outbox, and moves releases when results arrive
(`record_result`, from the record_job_result task) or when the watch finds a job
whose agent went silent or that ran past its time limit (`watch_jobs`, beat).
Every step re-reads the state and continues from there, so repeating one (a
redelivered task, a duplicate result) does no harm: a result counts once, for the
attempt in force.

    verifying:   verify_source                      -> compressing
    compressing: compress, then sign, then verify   -> evaluating
    evaluating:  evaluate and load_test in parallel -> gated
    gated:       gates (here) -> awaiting_approval | failed | stays (inconclusive)
                 (a re-measure sends evaluate and/or load_test again from gated,
                 awaiting_approval or a gate's fail; the gate waits for them)
    approved -> deploying: deploy -> live
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.audit.actions import on_behalf_of_agent
from controlplane.dispatch.actions import do_enqueue_task
from controlplane.dispatch.models import OutboxMessage
from controlplane.errors import IllegalTransition
from controlplane.fleet import programs
from controlplane.fleet.actions import (
    do_record_heartbeat,
    do_set_agent_state,
    silent_agents,
)
from controlplane.fleet.keys import seal_job_request
from controlplane.fleet.models import Agent, Deployment
from controlplane.releases import evidence, placing, stages
from controlplane.releases.actions.deployments import (
    do_complete_deployment,
    do_fail_deployment,
    do_mark_unloaded,
    do_quarantine_release,
    do_record_stray_server,
    do_refuse_deployment,
    do_start_deployment,
)
from controlplane.releases.actions.gate_policies import gate_policy_for
from controlplane.releases.actions.gate_results import do_evaluate_release_gates
from controlplane.releases.actions.jobs import (
    do_dispatch_job,
    do_finish_job,
    do_mark_job_running,
    do_retry_job,
    do_start_job,
)
from controlplane.releases.actions.remeasure import (
    REMEASURE_KINDS,
    do_request_remeasure,
)
from controlplane.releases.actions.rollbacks import (
    do_auto_rollback_environment,
    do_continue_rollback,
    previous_verified_deployment,
)
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Job, Release
from gpuagent.protocol import VERIFICATION_ERROR_CODES, Heartbeat, JobResult

log = logging.getLogger(__name__)
WORKER = "system:worker"
RUN_JOB = "gpuagent.run_job"

PROMOTION: dict[str, tuple[tuple[tuple[str, ...], ...], str]] = {
    "verifying": ((("verify_source",),), "compressing"),
    "compressing": ((("compress",), ("sign",), ("verify",)), "evaluating"),
    "evaluating": ((("evaluate", "load_test"),), "gated"),
}
FAILURE_STATE = {"verify_source": "failed_verification"}
AGENT_KINDS = tuple(k for groups, _ in PROMOTION.values() for g in groups for k in g)
AGENT_KINDS += ("deploy", "reverify", "undeploy")
OPEN_STATES = ("queued", "running")


# -- sending jobs ----------------------------------------------------------------------


def _live_agents():
    cutoff = timezone.now() - timedelta(seconds=settings.AGENT_DEAD_AFTER_S)
    return Agent.objects.filter(state="online", last_heartbeat__gte=cutoff)


class NoAgentQualifies(Exception):
    """No live enrolled agent may run the job (`reason` says why)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def queue_for(job: Job, exclude: Agent | None = None) -> str:
    """Where `job` goes: signing to an agent that holds a signing key; verify to
    another agent than the one that signed, when one is alive; a deploy that
    starts an external backend to an enrolled agent whose record allows its
    command (controlplane.fleet.programs; NoAgentQualifies when none is live); a
    live copy's re-verification to the agent that serves it; the rest to the
    pool."""
    agents = _live_agents()
    if exclude is not None:
        agents = agents.exclude(pk=exclude.pk)
    agents = list(agents.order_by("name"))
    pool = settings.RELEASEGATE_AGENT_POOL_QUEUE
    if job.kind == "sign":
        signers = [a for a in agents if a.capabilities.get("can_sign")]
        return signers[0].queue if signers else pool
    if job.kind == "verify":
        signed = evidence.latest_succeeded(job.release, "sign")
        signer = signed.agent_id if signed else None
        others = [a for a in agents if a.pk != signer]
        return others[0].queue if others else pool
    if job.kind == "deploy":
        deployment = stages.deployment_of(job)
        template = programs.external_template(stages.backend_for(job, deployment))
        placed = (
            deployment.agent
            if deployment is not None and deployment.placement
            else None
        )
        # Placed on an agent's devices: that agent, which placement chose among
        # those whose record allows the backend's command (deploy_agents).
        if placed is not None and placed in agents:
            if not template or programs.eligible_agents([placed], template):
                return placed.queue
        if template:
            return _external_deploy_queue(agents, template)
    if job.kind in ("reverify", "undeploy"):
        deployment = stages.deployment_of(job)
        if deployment is not None and deployment.agent is not None:
            return deployment.agent.queue
    return pool


def deploy_agents(deployment: Deployment):
    """The live agents `deployment` may be placed on: for an external backend,
    only enrolled agents whose record allows its command."""
    agents = _live_agents()
    template = programs.external_template(
        stages.job_backend(deployment.environment.serving_backend)
    )
    if not template:
        return agents
    eligible = programs.eligible_agents(agents.filter(enrollment="enrolled"), template)
    return agents.filter(pk__in=[a.pk for a in eligible])


def _external_deploy_queue(agents: list[Agent], template: str) -> str:
    """The queue of the first live enrolled agent allowed to start `template`
    (never the pool: an agent there may start anything its own list allows)."""
    enrolled = [a for a in agents if a.is_enrolled]
    eligible = programs.eligible_agents(enrolled, template)
    if eligible:
        return eligible[0].queue
    why = "; ".join(programs.record_problem(a, template) for a in enrolled)
    raise NoAgentQualifies(
        "no live enrolled agent may start this environment's serving backend"
        + (f": {why}" if why else " (none is online)")
    )


def _send(job: Job, exclude: Agent | None = None) -> None:
    """Queue `job`'s sealed request; when no agent may run it, the job fails at
    once with the reason, and what it belongs to moves on (`_after`)."""
    if job.kind == "deploy" and exclude is not None:
        _place_elsewhere(job, exclude)
    try:
        queue = queue_for(job, exclude)
    except NoAgentQualifies as exc:
        do_finish_job(job, error=exc.reason)
        _after(job)
        return
    request = stages.request_for(job)
    body = request.model_dump(mode="json")
    # Sealed with the control plane's key: agents refuse any other request.
    sealed = seal_job_request(request, body)
    do_enqueue_task(RUN_JOB, body, sealed, queue=queue)


def _place_elsewhere(job: Job, exclude: Agent) -> None:
    """A deploy resent away from the agent it was placed on is placed again on
    the other live agents (left as it was when none of them has room)."""
    deployment = stages.deployment_of(job)
    if (
        deployment is None
        or deployment.state != "deploying"
        or not deployment.placement
        or deployment.agent_id != exclude.pk
    ):
        return
    placing.place_deployment(
        deployment, deploy_agents(deployment).exclude(pk=exclude.pk)
    )
    deployment.refresh_from_db()  # what request_for reads


def dispatch(
    release: Release, kind: str, *, deployment: Deployment | None = None
) -> Job:
    job = do_dispatch_job(release, kind, deployment=deployment)
    _send(job)
    return job


# -- promotion ---------------------------------------------------------------------


def advance(release_id: int) -> str:
    """Move the release as far as its recorded jobs allow, sending the jobs of the
    stage it reaches; returns its state ("missing" for no such release)."""
    with transaction.atomic():
        release = Release.objects.select_for_update().filter(pk=release_id).first()
        if release is None:
            return "missing"
        try:
            if release.state == "registered":
                do_transition_release(release, "verifying", actor=WORKER)
            while release.state in PROMOTION and _advance_stage(release):
                pass
            if release.state == "gated" and not remeasure_pending(release):
                run_gate(release)
        except IllegalTransition:
            release.refresh_from_db()
            log.info("release %s moved concurrently; now %s", release.pk, release.state)
        return release.state


def _advance_stage(release: Release) -> bool:
    """True when the release moved to the next state."""
    groups, next_state = PROMOTION[release.state]
    entered = release.state_entered_at
    for group in groups:
        jobs = {
            kind: release.jobs.filter(kind=kind, created__gte=entered)
            .order_by("-id")
            .first()
            for kind in group
        }
        missing = [kind for kind, job in jobs.items() if job is None]
        for kind in missing:
            dispatch(release, kind)
        if missing or any(job.state in OPEN_STATES for job in jobs.values()):
            return False
        failed = [job for job in jobs.values() if job.state == "failed"]
        if failed:
            job = failed[0]
            do_transition_release(
                release,
                FAILURE_STATE.get(job.kind, "failed"),
                actor=WORKER,
                reason=f"{job.kind}: {job.error}",
            )
            return False
    do_transition_release(release, next_state, actor=WORKER)
    return True


def remeasure(release: Release, stages: list[str], actor) -> Release:
    """Re-run the release's `stages` (evaluate, load_test), then its gate: the
    release goes to gated and the jobs are sent (actions.remeasure says when)."""
    with transaction.atomic():
        for job in do_request_remeasure(release, actor, stages=stages):
            _send(job)
    return release


def remeasure_pending(release: Release) -> bool:
    """Whether the gate must wait: a job of a re-measure (an evaluate or load_test
    job created since the release entered gated) is still open, or one failed,
    which fails the release as it would have in evaluating."""
    for kind in REMEASURE_KINDS:
        job = (
            release.jobs.filter(kind=kind, created__gte=release.state_entered_at)
            .order_by("-id")
            .first()
        )
        if job is None:
            continue
        if job.state in OPEN_STATES:
            return True
        if job.state == "failed":
            do_transition_release(
                release, "failed", actor=WORKER, reason=f"{job.kind}: {job.error}"
            )
            return True
    return False


def run_gate(release: Release) -> bool:
    """Hold the recorded evidence against the environment's policy; pass moves to
    awaiting_approval, fail to failed, inconclusive pauses in gated."""
    job = do_start_job(release, "gate")
    try:
        quality, load = evidence.quality_report(release), evidence.load_report(release)
    except evidence.EvidenceUnreadable as exc:
        do_finish_job(job, error=exc.message)
        do_transition_release(release, "failed", actor=WORKER, reason=exc.message)
        return False
    decision = do_evaluate_release_gates(
        release, quality=quality, load=load, integrity_ok=evidence.integrity_ok(release)
    )
    result = {"outcome": decision.outcome, "reason": decision.reason}
    if decision.outcome == "inconclusive":
        do_finish_job(job, result=result)
        return False
    do_finish_job(job, result=result, error="" if decision.ok else decision.reason)
    if decision.ok:
        do_transition_release(release, "awaiting_approval", actor=WORKER)
    else:
        do_transition_release(release, "failed", actor=WORKER, reason=decision.reason)
    return decision.ok


# -- deployment -------------------------------------------------------------------


def deploy(release_id: int) -> str:
    """approved -> deploying with a deploy job on an agent; also sends the deploy
    job of a rollback (release already deploying). Returns the release's state."""
    with transaction.atomic():
        release = Release.objects.select_for_update().filter(pk=release_id).first()
        if release is None:
            return "missing"
        if release.state == "approved":
            do_start_deployment(release, actor=WORKER)
        if release.state != "deploying":
            return release.state
        deployment = (
            Deployment.objects.filter(release=release, state="deploying")
            .order_by("-started", "-id")
            .first()
        )
        if deployment is None:
            deployment = do_start_deployment(
                release, actor=WORKER, environment=release.target_environment
            )
        sent = release.jobs.filter(kind="deploy", created__gte=deployment.started)
        if not sent.exists():
            refused = placing.place_deployment(deployment, deploy_agents(deployment))
            if refused:
                _unplaceable(deployment, refused)
                release.refresh_from_db()
                return release.state
            deployment.refresh_from_db()  # the placement recorded
            dispatch(release, "deploy", deployment=deployment)
            release.refresh_from_db(fields=["state"])  # no agent may: it failed
        return release.state


def _unplaceable(deployment: Deployment, why: str) -> None:
    """No agent has room for `deployment`: it fails with `why` (no job sent),
    and a rollback goes on to its next candidate."""
    deployment = do_fail_deployment(deployment, actor=WORKER, reason=why)
    if deployment.rollback_tried is not None:
        do_continue_rollback(deployment, why=why)


def _deployment_done(job: Job) -> None:
    deployment = stages.deployment_of(job)
    if deployment is None:
        return
    if deployment.state != "deploying":
        _stop_stray_server(deployment, job)
        return
    if job.state == "succeeded":
        # Checked under the lock of every release holding the digest: a digest
        # quarantined after the deploy job was sent (its request carried the
        # quarantine list of then) never goes live.
        untrusted = stages.untrusted_now(deployment.release)
        if untrusted:
            _refuse_deployment(deployment, job, untrusted)
            return
        do_complete_deployment(
            deployment,
            actor=WORKER,
            endpoint=str(job.result.get("endpoint", "")),
            agent=job.agent,
            serving_id=str(job.result.get("deployment_id", "")),
        )
        undeploy_older(deployment.environment)
    else:
        do_fail_deployment(
            deployment,
            actor=WORKER,
            reason=job.error + _stopped_for_room(deployment),
            verification=failed_verification(job),
        )
        if deployment.rollback_tried is not None:
            do_continue_rollback(deployment, why=why_refused(job))


def _stopped_for_room(deployment: Deployment) -> str:
    """What a failed deploy leaves stopped: the servers its placement stopped
    first (cold, kept verified on disk; a rollback or a redeploy restarts them)."""
    stopped = (deployment.placement or {}).get("stop_first") or []
    if not stopped:
        return ""
    return (
        f" (its placement stopped {', '.join(stopped)} first to make room: cold "
        "until a rollback or a redeploy restarts them)"
    )


def _refuse_deployment(deployment: Deployment, job: Job, why: str) -> None:
    """The agent served `deployment` but the control plane won't make it live
    (`why`): fail it, stop its server, and let a rollback try its next one."""
    serving_id = str(job.result.get("deployment_id", ""))
    deployment = do_refuse_deployment(
        deployment, actor=WORKER, reason=why, agent=job.agent, serving_id=serving_id
    )
    if deployment.serving_id:
        dispatch(deployment.release, "undeploy", deployment=deployment)
    if deployment.rollback_tried is not None:
        do_continue_rollback(deployment, why=why)


def _stop_stray_server(deployment: Deployment, job: Job) -> None:
    """A deploy that answers after its deployment failed meanwhile (e.g. a copy
    of its release failed re-verification): the server it started is stopped."""
    serving_id = str(job.result.get("deployment_id", ""))
    if job.state != "succeeded" or not serving_id:
        return
    deployment = do_record_stray_server(
        deployment, agent=job.agent, serving_id=serving_id
    )
    dispatch(deployment.release, "undeploy", deployment=deployment)


def failed_verification(job: Job) -> bool:
    """Whether a failed deploy job says the bytes are not the approved ones: by the
    error code its DeployResult carries, never by the words of its message."""
    return job.result.get("error_code") in VERIFICATION_ERROR_CODES


def why_refused(job: Job) -> str:
    """A failed deploy job in a few words: the files that differ, else its error."""
    lists = [
        f"{key}: {', '.join(job.result[key])}"
        for key in ("changed", "missing", "extra")
        if job.result.get(key)
    ]
    why = "; ".join(lists) or job.error or "deploy failed"
    return why if len(why) <= 200 else why[:199] + "…"


def undeploy_older(environment) -> list[Job]:
    """Send an undeploy job for every release whose server still runs for
    `environment` but is neither what it serves nor its rollback target (the
    previous verified release), so superseded servers don't pile up on the
    agents. A release served anywhere else keeps its server; one already sent
    an undeploy since its last deployment ended is not sent another."""
    serving = Deployment.objects.serving().values_list("release_id", flat=True)
    keep = set(serving)
    target = previous_verified_deployment(environment)
    if target is not None:
        keep.add(target.release_id)
    older = (
        environment.deployments.filter(ended__isnull=False)
        .exclude(serving_id="")
        .exclude(release_id__in=keep)
        .values_list("release_id", flat=True)
        .distinct()
    )
    sent = []
    for release in Release.objects.filter(pk__in=set(older)).order_by("pk"):
        last = release.deployments.order_by("-started", "-id").first()
        if last is None or last.ended is None or not last.serving_id:
            continue  # deploying again (a rollback), or never loaded
        if last.unloaded is not None:
            continue  # stopped already (a placement made room with it)
        if release.jobs.filter(kind="undeploy", created__gte=last.ended).exists():
            continue
        sent.append(dispatch(release, "undeploy"))
        same_server = release.deployments.filter(serving_id=last.serving_id)
        do_mark_unloaded(same_server, actor=WORKER)
    return sent


def reverify(deployment_id: int) -> str:
    """Send a re-verification of a live deployment's copy to the agent serving it."""
    with transaction.atomic():
        deployment = (
            Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        )
        if deployment is None:
            return "missing"
        if deployment.state != "live":
            return deployment.state
        if deployment.agent is not None and deployment.agent.enrollment == "revoked":
            return "agent-revoked"  # nothing it says is believed any more
        release = deployment.release
        if release.jobs.filter(kind="reverify", state__in=OPEN_STATES).exists():
            return "busy"
        dispatch(release, "reverify", deployment=deployment)
        return deployment.state


def _reverified(job: Job) -> None:
    """A failed re-verification is about the copy of the deployment it was sent
    for. Still live: the deployment fails verification (and the environment's
    policy may roll back). Superseded or rolled back meanwhile: the release is
    quarantined whatever its state, so it is never a rollback target; live again
    elsewhere: that deployment fails verification; deploying again: that deploy
    fails (`_fail_deploying_copy`)."""
    deployment = stages.deployment_of(job)
    if deployment is None or job.state == "succeeded":
        return
    if deployment.state != "live":
        current = (
            deployment.release.deployments.filter(
                state__in=("live", "deploying"), ended__isnull=True
            )
            .order_by("-started", "-id")
            .first()
        )
        if current is None:
            do_quarantine_release(
                deployment.release,
                actor=WORKER,
                reason=f"its copy in {deployment.environment.name} failed "
                f"re-verification after it stopped being live: {job.error}",
            )
            return
        deployment = current
    if deployment.state == "deploying":
        _fail_deploying_copy(deployment, job.error)
        return
    do_fail_deployment(deployment, actor=WORKER, reason=job.error, verification=True)
    environment = deployment.environment
    if gate_policy_for(environment).auto_rollback_on_failed_verification:
        do_auto_rollback_environment(
            environment,
            reason=f"{deployment.release} failed re-verification in "
            f"{environment.name}: {job.error}",
        )


def _fail_deploying_copy(deployment: Deployment, error: str) -> None:
    """A copy of a release deploying again (a rollback to it, a roll forward)
    failed re-verification: that deploy fails verification and ends, the release
    is quarantined, and a rollback goes on to its next candidate. Should the
    deploy still answer, its server is stopped (`_stop_stray_server`)."""
    why = f"a copy failed re-verification while it was deploying again: {error}"
    deployment = do_fail_deployment(
        deployment, actor=WORKER, reason=why, verification=True, ended=True
    )
    if deployment.rollback_tried is not None:
        do_continue_rollback(deployment, why=why)
    else:
        do_quarantine_release(deployment.release, actor=WORKER, reason=why)


# -- results and the watch ------------------------------------------------------------


def record_result(result: JobResult, attempt: int, agent: Agent) -> str:
    """Record an agent's answer and move the release on. A result for a finished
    job, or from an attempt no longer in force (a retried job's old agent), changes
    nothing: returns "ignored". `agent` is the enrolled agent whose seal the
    intake checked (controlplane.releases.intake), never a name the result says;
    what it sets off is audited as that agent's."""
    with on_behalf_of_agent(agent.name):
        return _record_result(result, attempt, agent)


def _record_result(result: JobResult, attempt: int, agent: Agent) -> str:
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .select_related("release")
            .filter(pk=result.job_id)
            .first()
        )
        if job is None:
            return "missing"
        stale = job.state not in OPEN_STATES or job.attempts != attempt
        if stale or job.kind != result.kind:
            log.info(
                "ignored %s result of job %s (attempt %s)", result.kind, job.pk, attempt
            )
            return "ignored"
        stages.record(job, result, agent)
        _after(job)
        return job.state


def _after(job: Job) -> None:
    """What a finished job moves: its release's promotion, deployment or copy."""
    if job.kind == "deploy":
        _deployment_done(job)
    elif job.kind == "reverify":
        _reverified(job)
    elif job.kind == "undeploy":
        return  # a stopped server moves no release
    elif job.kind in AGENT_KINDS:
        advance(job.release_id)


def record_progress(job_id: int, attempt: int, agent: Agent, progress: float) -> bool:
    """`agent` (sealed, enrolled: the intake checked) runs `attempt` of the job."""
    with on_behalf_of_agent(agent.name):
        job = Job.objects.filter(pk=job_id).first()
        if job is None:
            return False
        return do_mark_job_running(job, attempt=attempt, agent=agent, progress=progress)


def retry_or_fail(job: Job, reason: str, *, avoid_agent: bool = True) -> str:
    """Send `job` again, to another agent than the one it had where `avoid_agent`
    and another can do it, or, after RELEASEGATE_JOB_MAX_ATTEMPTS, fail it (and so
    its release or deployment) with `reason`."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).get(pk=job.pk)
        if job.state not in OPEN_STATES:
            return job.state
        if job.attempts >= settings.RELEASEGATE_JOB_MAX_ATTEMPTS:
            do_finish_job(
                job, error=f"{reason}; gave up after {job.attempts} attempt(s)"
            )
            _after(job)
            return "failed"
        return _resend(job, reason, exclude=job.agent if avoid_agent else None)


def _resend(job: Job, reason: str, *, exclude: Agent | None) -> str:
    job = do_retry_job(job, reason=reason)
    _send(job, exclude=exclude)
    return "retried" if job.state in OPEN_STATES else job.state


def resend_from_revoked(job: Job, agent: Agent, reason: str) -> str:
    """Send `job`, which revoked `agent` held or had waiting on its queue, to
    another agent at once with a new attempt (whatever attempts it had: the
    revocation is no fault of the job's); the old attempt's result no longer
    counts. A re-verification or undeploy of a copy that `agent` serves can go
    nowhere else: it fails with `reason`, and the deployment is left as it is
    (the control plane learnt nothing of the copy)."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).get(pk=job.pk)
        if job.state not in OPEN_STATES:
            return job.state
        if job.kind in ("reverify", "undeploy"):
            deployment = stages.deployment_of(job)
            if deployment is not None and deployment.agent_id == agent.pk:
                why = f"{reason}; only it serves this copy"
                return do_finish_job(job, error=why).state
        return _resend(job, reason, exclude=agent)


def record_heartbeat(beat: Heartbeat) -> Agent:
    """Record an agent's heartbeat. The first beat of a new incarnation (the agent
    restarted under its name, e.g. killed and started again sooner than
    AGENT_DEAD_AFTER_S would tell) sends again, at once and in the same
    transaction, every job its earlier incarnation held: those died with it.
    What it sets off is audited as that agent's."""
    with on_behalf_of_agent(beat.agent):
        return _record_heartbeat(beat)


def _record_heartbeat(beat: Heartbeat) -> Agent:
    with transaction.atomic():
        earlier = Agent.objects.select_for_update().filter(name=beat.agent).first()
        agent = do_record_heartbeat(beat)
        if earlier is None or earlier.incarnation in ("", agent.incarnation):
            return agent
        reason = f"agent {agent.name} restarted; the job died with its earlier run"
        for job in jobs_held_by(earlier).exclude(pk__in=beat.running_jobs):
            # The agent is back: it may take the job again (it may be the only
            # one able to, e.g. the only signer).
            retry_or_fail(job, reason, avoid_agent=False)
    return agent


def jobs_held_by(agent: Agent):
    """The open agent jobs `agent` holds as the control plane last heard: running
    on it by its progress reports, or, while it was not offline, listed in its last
    heartbeat and taken by no agent since (its progress report not in yet). (An
    offline agent's jobs were sent away by the watch already.)"""
    open_jobs = Job.objects.filter(kind__in=AGENT_KINDS, state__in=OPEN_STATES)
    held = Q(agent=agent)
    if agent.state != "offline":
        held |= Q(pk__in=agent.running_jobs or [], agent__isnull=True)
    return open_jobs.filter(held).order_by("pk")


def jobs_sent_to(agent: Agent):
    """The open agent jobs no agent has taken yet whose request for the attempt in
    force went to `agent`'s own queue (the outbox keeps where each went)."""
    waiting = dict(
        Job.objects.filter(
            kind__in=AGENT_KINDS, state="queued", agent__isnull=True
        ).values_list("pk", "attempts")
    )
    sent = OutboxMessage.objects.filter(
        task=RUN_JOB, queue=agent.queue, args__0__job_id__in=list(waiting)
    )
    ids = [
        body["job_id"]
        for body in (message.args[0] for message in sent)
        if waiting.get(body["job_id"]) == body.get("attempt")
    ]
    return Job.objects.filter(pk__in=ids).order_by("pk")


def watch_jobs() -> dict[str, int]:
    """Beat: mark agents whose heartbeats stopped offline and retry their jobs;
    retry jobs past their time limit, and jobs no agent took in time."""
    now = timezone.now()
    silent = list(silent_agents(settings.AGENT_DEAD_AFTER_S))
    for agent in silent:
        do_set_agent_state(agent, "offline", actor="system:fleet")
    counts = {"agents_offline": len(silent), "retried": 0, "failed": 0}
    open_jobs = Job.objects.filter(kind__in=AGENT_KINDS, state__in=OPEN_STATES)
    for job in open_jobs.select_related("agent"):
        if job.agent is not None and job.agent.state == "offline":
            reason = f"agent {job.agent.name} stopped sending heartbeats"
        elif job.lease_expires is not None and job.lease_expires < now:
            reason = (
                f"no result within {settings.RELEASEGATE_JOB_TIME_LIMIT_S:.0f} s"
                if job.state == "running"
                else f"no agent took it within "
                f"{settings.RELEASEGATE_JOB_QUEUE_TIMEOUT_S:.0f} s"
            )
        else:
            continue
        outcome = retry_or_fail(job, reason)
        counts["retried" if outcome == "retried" else "failed"] += 1
    return counts
