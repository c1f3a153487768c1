"""Where agent messages arrive: results, progress reports and heartbeats are
believed only when sealed (gpuagent.integrity.identity) by an enrolled agent's
key, fresh, never seen before, and bound to the job, attempt, kind and release
they claim; a result only from the agent that took the job, a sign result only
with a signature that verifies against the signer's enrolled key, a verify result
only from another agent than the signer, a deploy result that starts an external
backend only from an agent enrolled to start its command
(controlplane.fleet.programs). Everything else is refused and audited
(`agent.message_refused`), and changes nothing. What passes goes to the pipeline
(controlplane.releases.pipeline) with the enrolled agent, never a name a message
gives itself. A heartbeat of a key no agent holds files a pending enrollment."""

import logging

from django.conf import settings
from django.db import transaction

from controlplane.fleet import programs
from controlplane.fleet.enrollment import (
    do_accept_message,
    do_record_message_refused,
    do_request_enrollment,
    do_revoke_agent,
    enrolled_agent,
)
from controlplane.fleet.models import Agent
from controlplane.releases import evidence, pipeline, stages
from controlplane.releases.models import Job
from controlplane.releases.signature_check import sign_result_problem
from gpuagent.integrity import identity
from gpuagent.protocol import Heartbeat, JobResult, Seal, VerifyResult

log = logging.getLogger(__name__)
OPEN_STATES = pipeline.OPEN_STATES


class Refused(Exception):
    def __init__(self, reason: str, agent: Agent | None = None, signer: str = ""):
        super().__init__(reason)
        self.reason, self.agent, self.signer = reason, agent, signer


def _refuse(exc: Refused, *, type: str, job_id=None) -> str:
    recorded = do_record_message_refused(
        exc.reason, type=type, signer=exc.signer, job_id=job_id, agent=exc.agent
    )
    # Logged as audited: a flood's first refusal of a kind in full, the rest
    # counted (debug only, so a flood does not flood the log either).
    level = logging.WARNING if recorded is not None else logging.DEBUG
    log.log(level, "refused %s message (job %s): %s", type, job_id, exc.reason)
    return "refused"


def _parse_seal(seal) -> Seal:
    if seal is None:
        raise Refused("unsigned message")
    try:
        return Seal.model_validate(seal)
    except ValueError as exc:
        raise Refused(f"malformed seal: {exc}") from exc


def _check(sealed: Seal, raw_key: bytes, body, agent=None, **expected) -> None:
    """The seal holds for `body` and `expected`, and was not seen before."""
    try:
        identity.check_seal(
            sealed,
            raw_key,
            body,
            max_skew_s=settings.RELEASEGATE_MESSAGE_MAX_SKEW_S,
            **expected,
        )
    except identity.SealRefused as exc:
        raise Refused(str(exc), agent, sealed.signer) from exc
    if not do_accept_message(sealed.signer, sealed.nonce):
        raise Refused("replayed: this message was seen before", agent, sealed.signer)


def sender(seal, body, **expected) -> Agent:
    """The enrolled agent that sealed `body`; Refused naming why not."""
    sealed = _parse_seal(seal)
    agent = enrolled_agent(sealed.signer)
    if agent is None:
        raise Refused("sealed by a key no agent is enrolled with", None, sealed.signer)
    if agent.enrollment == "revoked":
        raise Refused(f"agent {agent.name} is revoked", agent, sealed.signer)
    _check(sealed, bytes.fromhex(agent.public_key), body, agent, **expected)
    return agent


# -- results ---------------------------------------------------------------------


def accept_result(result: dict, attempt: int, seal: dict | None) -> str:
    """Record an agent's sealed JobResult (pipeline.record_result), or refuse it:
    returns the job's state, "ignored", "missing" or "refused"."""
    job_id = result.get("job_id") if isinstance(result, dict) else None
    try:
        parsed = JobResult.model_validate(result)
        if not isinstance(attempt, int):
            raise ValueError("attempt is not an integer")
    except ValueError as exc:
        return _refuse(
            Refused(f"malformed result: {exc}"), type="result", job_id=job_id
        )
    try:
        # One transaction: the nonce is kept only with what the message records.
        with transaction.atomic():
            agent = sender(
                seal,
                result,
                type="result",
                job_id=job_id,
                attempt=attempt,
                kind=parsed.kind,
            )
            job = (
                # Not `agent`'s row: PostgreSQL cannot lock an outer join's
                # nullable side (the job may have no agent yet).
                Job.objects.select_for_update(of=("self", "release"))
                .select_related("release", "agent")
                .filter(pk=parsed.job_id)
                .first()
            )
            if job is None:
                return "missing"
            _check_result(job, parsed, attempt, agent, Seal.model_validate(seal))
            named = parsed.model_copy(update={"agent": agent.name})
            return pipeline.record_result(named, attempt, agent)
    except Refused as exc:
        outcome = _refuse(exc, type="result", job_id=job_id)
        if getattr(exc, "retry", False):
            pipeline.retry_or_fail(Job.objects.get(pk=job_id), exc.reason)
        return outcome


def _check_result(job: Job, result: JobResult, attempt: int, agent, sealed) -> None:
    if sealed.release_id != job.release_id:
        raise Refused(
            f"sealed for release {sealed.release_id}; job {job.pk} is release "
            f"{job.release_id}'s",
            agent,
            sealed.signer,
        )
    if job.state not in OPEN_STATES or job.attempts != attempt:
        return  # an old attempt's or a duplicate: the pipeline ignores it
    if job.agent_id is not None and job.agent_id != agent.pk:
        raise Refused(
            f"job {job.pk} runs on agent {job.agent.name}, not {agent.name}",
            agent,
            sealed.signer,
        )
    if job.kind == "deploy":
        _check_programs(job, agent, sealed)
    if not result.ok:
        return
    release = job.release
    if job.kind == "sign":
        problem = sign_result_problem(release, result.payload, agent)
        if problem:
            raise Refused(problem, agent, sealed.signer)
    elif job.kind == "verify":
        signed = evidence.latest_succeeded(release, "sign")
        if (
            signed is not None
            and signed.agent_id == agent.pk
            and not settings.RELEASEGATE_ALLOW_VERIFY_ON_SIGNER
        ):
            refused = Refused(
                f"verify must run on another enrolled agent than the signer "
                f"({agent.name})",
                agent,
                sealed.signer,
            )
            refused.retry = True  # send it to another agent
            raise refused
        try:
            verified = VerifyResult.model_validate(result.payload)
        except ValueError as exc:
            raise Refused(
                f"malformed verify result: {exc}", agent, sealed.signer
            ) from exc
        if verified.manifest_digest != release.manifest_digest:
            raise Refused(
                f"verified {verified.manifest_digest}, not the signed "
                f"{release.manifest_digest}",
                agent,
                sealed.signer,
            )


def _check_programs(job: Job, agent: Agent, sealed: Seal) -> None:
    """A deploy that starts an external backend counts only from an agent whose
    enrollment allows its command (controlplane.fleet.programs); another's answer
    is refused and the job sent to an agent that may run it."""
    template = programs.external_template(stages.backend_for(job))
    problem = programs.record_problem(agent, template)
    if problem:
        refused = Refused(problem, agent, sealed.signer)
        refused.retry = True
        raise refused


# -- progress --------------------------------------------------------------------


def accept_progress(job_id, attempt, agent_name, progress, seal) -> bool:
    """Record that the sealing agent runs `attempt` of the job (and how far)."""
    body = {
        "job_id": job_id,
        "attempt": attempt,
        "agent": agent_name,
        "progress": progress,
    }
    try:
        if not (
            isinstance(job_id, int)
            and isinstance(attempt, int)
            and isinstance(progress, int | float)
        ):
            raise Refused("malformed progress report")
        # One transaction: the nonce is kept only with what the message records.
        with transaction.atomic():
            agent = sender(seal, body, type="progress", job_id=job_id, attempt=attempt)
            sealed = Seal.model_validate(seal)
            job = Job.objects.select_related("agent").filter(pk=job_id).first()
            if job is None:
                return False
            if sealed.release_id != job.release_id or sealed.kind != job.kind:
                raise Refused(
                    f"sealed for release {sealed.release_id} ({sealed.kind}); job "
                    f"{job.pk} is release {job.release_id}'s {job.kind}",
                    agent,
                    sealed.signer,
                )
            open_now = job.state in OPEN_STATES and job.attempts == attempt
            if open_now and job.agent_id not in (None, agent.pk):
                raise Refused(
                    f"job {job.pk} runs on agent {job.agent.name}, not {agent.name}",
                    agent,
                    sealed.signer,
                )
            return pipeline.record_progress(job_id, attempt, agent, float(progress))
    except Refused as exc:
        _refuse(
            exc, type="progress", job_id=job_id if isinstance(job_id, int) else None
        )
        return False


# -- heartbeats ------------------------------------------------------------------


def accept_heartbeat(beat: dict, seal: dict | None) -> str:
    """Record an enrolled agent's beat under its enrolled name, queue, pool and
    capabilities (never the ones the beat gives); a beat sealed by a key no agent
    holds (checked against the public key it presents) files a pending
    enrollment: returns the agent's state, "pending" or "refused"."""
    try:
        try:
            parsed = Heartbeat.model_validate(beat)
        except ValueError as exc:
            raise Refused(f"malformed heartbeat: {exc}") from exc
        sealed = _parse_seal(seal)
        # One transaction: the nonce is kept only with what the beat records.
        with transaction.atomic():
            agent = enrolled_agent(sealed.signer)
            if agent is None:
                return _pending(parsed, beat, sealed)
            if agent.enrollment == "revoked":
                raise Refused(f"agent {agent.name} is revoked", agent, sealed.signer)
            key = bytes.fromhex(agent.public_key)
            _check(sealed, key, beat, agent, type="heartbeat")
            enrolled = parsed.model_copy(
                update={
                    "agent": agent.name,
                    "queue": agent.queue,
                    "pool_queue": agent.pool_queue,
                    "can_sign": agent.can_sign,
                }
            )
            return pipeline.record_heartbeat(enrolled).state
    except Refused as exc:
        return _refuse(exc, type="heartbeat")


def _pending(beat: Heartbeat, body: dict, sealed: Seal) -> str:
    if not beat.public_key or identity.fingerprint(bytes.fromhex(beat.public_key)) != (
        sealed.signer
    ):
        raise Refused(
            "sealed by a key no agent is enrolled with (and not the key the beat "
            "presents)",
            None,
            sealed.signer,
        )
    _check(sealed, bytes.fromhex(beat.public_key), body, type="heartbeat")
    request = do_request_enrollment(beat)
    if request is None:
        raise Refused("too many enrollments pending", None, sealed.signer)
    if request.state != "pending":
        raise Refused(f"this key's enrollment was {request.state}", None, sealed.signer)
    return "pending"


# -- revocation ------------------------------------------------------------------


def revoke_agent(agent: Agent, *, actor) -> Agent:
    """Revoke `agent` (its messages refused from now on) and, in the same
    transaction, send every job it holds to another agent with a new attempt:
    those it runs (by its progress reports or its last heartbeat) and those
    waiting on its own queue (pipeline.resend_from_revoked). Nothing is revoked
    when a job cannot be sent."""
    with transaction.atomic():
        # Its last heartbeat's jobs count as held only while it is not offline:
        # read them before the revocation takes it offline.
        locked = Agent.objects.select_for_update().get(pk=agent.pk)
        held = {job.pk for job in pipeline.jobs_held_by(locked)}
        held |= {job.pk for job in pipeline.jobs_sent_to(locked)}
        agent = do_revoke_agent(locked, actor=actor)
        reason = f"agent {agent.name} was revoked"
        for job in Job.objects.filter(pk__in=held).order_by("pk"):
            pipeline.resend_from_revoked(job, agent, reason)
    return agent
