"""Agent enrollment: who an agent is comes from an operator's approval of its key,
never from what its messages say (as Kubernetes approves a node's bootstrap CSR).

A sealed heartbeat from a key no agent holds files an EnrollmentRequest, nothing
more; a platform operator (staff) enrolls it, giving its name, pool and
capabilities (may sign, allowed programs, the devices it may use: by default
those it reported when it asked), or rejects it; revoking an enrolled agent
refuses its messages from then on. `do_accept_message` is the replay check of
every sealed message, and `do_record_message_refused` audits refusals, bounded
per source, kind of reason and time window."""

import logging
import re
from datetime import timedelta
from types import SimpleNamespace

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.accounts.actions import is_system, user_of
from controlplane.accounts.models import ApiToken
from controlplane.audit.actions import (
    Actor,
    do_record_bounded_event,
    do_record_event,
)
from controlplane.errors import Conflict, Forbidden, ValidationFailed
from controlplane.fleet.models import Agent, EnrollmentRequest, SeenMessage
from controlplane.fleet.programs import clean_allowed_programs
from gpuagent.integrity import identity
from gpuagent.protocol import Heartbeat

log = logging.getLogger(__name__)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
ENROLL_FIELDS = ("name", "pool_queue", "can_sign", "allowed_programs", "devices")


def check_operator(actor: Actor) -> None:
    """Raise Forbidden unless `actor` is a platform operator: a staff or superuser
    account, through the API with an admin-scope token of one; or the system."""
    if is_system(actor):
        return
    if isinstance(actor, ApiToken) and "admin" not in actor.scopes:
        raise Forbidden("this API token lacks the 'admin' scope")
    user = user_of(actor)
    if user is None or not user.is_active or not (user.is_staff or user.is_superuser):
        raise Forbidden("enrolling or revoking agents needs a staff account")


def enrolled_agent(fingerprint: str) -> Agent | None:
    """The agent enrolled (or revoked) under this key fingerprint, if any."""
    return (
        Agent.objects.filter(fingerprint=fingerprint)
        .exclude(enrollment="")
        .order_by("-enrolled_at", "-id")
        .first()
    )


def do_accept_message(signer: str, nonce: str) -> bool:
    """Remember a sealed message's nonce; False when it was seen (a replay).
    Nonces older than twice the allowed skew are forgotten: a message that old
    is refused as stale before it gets here."""
    cutoff = timezone.now() - timedelta(
        seconds=2 * settings.RELEASEGATE_MESSAGE_MAX_SKEW_S
    )
    SeenMessage.objects.filter(seen__lt=cutoff).delete()
    try:
        with transaction.atomic():
            SeenMessage.objects.create(signer=signer, nonce=nonce)
    except IntegrityError:
        return False
    return True


def do_request_enrollment(beat: Heartbeat) -> EnrollmentRequest | None:
    """File (or refresh) the pending enrollment of the key that sealed `beat`
    (the caller checked the seal against `beat.public_key`). None when too many
    requests already wait (RELEASEGATE_MAX_PENDING_ENROLLMENTS)."""
    raw = identity.public_key_from_text(beat.public_key)
    fingerprint = identity.fingerprint(raw)
    details = {
        "requested_name": beat.agent[:100],
        "requested_pool": beat.pool_queue[:100],
        "signing_public_key": beat.signing_public_key,
        "device": beat.device,
        "gpu_model": beat.gpu_model[:100],
        "devices": [d.model_dump(exclude={"memory_free_bytes"}) for d in beat.devices],
        "last_seen": timezone.now(),
    }
    with transaction.atomic():
        request = (
            EnrollmentRequest.objects.select_for_update()
            .filter(fingerprint=fingerprint)
            .first()
        )
        if request is not None:
            if request.state == "pending":
                EnrollmentRequest.objects.filter(pk=request.pk).update(**details)
            return request
        waiting = EnrollmentRequest.objects.filter(state="pending").count()
        if waiting >= settings.RELEASEGATE_MAX_PENDING_ENROLLMENTS:
            return None
        request = EnrollmentRequest.objects.create(
            fingerprint=fingerprint, public_key=raw.hex(), **details
        )
        do_record_event(
            f"agent-key:{fingerprint[:16]}",
            "agent.enrollment_requested",
            request,
            after=request.to_dict(),
        )
    return request


def clean_enrollment(request: EnrollmentRequest, fields: dict) -> dict:
    """The enrollment's name, pool, capabilities: the operator's `fields`, else
    what the request suggested (never may-sign by default). ValidationFailed names
    a bad or unknown field."""
    unknown = sorted(set(fields) - set(ENROLL_FIELDS))
    if unknown:
        raise ValidationFailed(
            f"unknown field(s) {', '.join(unknown)}; expected "
            + ", ".join(ENROLL_FIELDS),
            field=unknown[0],
        )
    name = fields.get("name") or request.requested_name
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValidationFailed(
            "name must be 1-100 letters, digits, '.', '_' or '-'", field="name"
        )
    pool = fields.get("pool_queue") or settings.RELEASEGATE_AGENT_POOL_QUEUE
    if not isinstance(pool, str) or not NAME_PATTERN.match(pool):
        raise ValidationFailed("pool_queue must be a queue name", field="pool_queue")
    can_sign = fields.get("can_sign", False)
    if not isinstance(can_sign, bool):
        raise ValidationFailed("can_sign must be true or false", field="can_sign")
    if can_sign and not request.signing_public_key:
        raise ValidationFailed(
            "this agent presented no signing key: it cannot be enrolled to sign",
            field="can_sign",
        )
    programs = clean_allowed_programs(fields.get("allowed_programs"))
    return {
        "name": name,
        "pool_queue": pool,
        "can_sign": can_sign,
        "allowed_programs": programs,
        "devices": clean_devices(request, fields.get("devices")),
    }


def clean_devices(request: EnrollmentRequest, indices: object) -> list[dict]:
    """The devices the agent is enrolled to use: those of `indices` (None: every
    device it reported when it asked), each as it reported it (index, model,
    total memory). ValidationFailed for an index it did not report."""
    reported = {d["index"]: d for d in request.devices}
    if indices is None:
        return [reported[i] for i in sorted(reported)]
    if not (
        isinstance(indices, list)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
        and len(set(indices)) == len(indices)
    ):
        raise ValidationFailed(
            "devices must be a list of distinct device indices", field="devices"
        )
    unknown = sorted(set(indices) - set(reported))
    if unknown:
        raise ValidationFailed(
            f"devices: the agent reported no device {', '.join(map(str, unknown))} "
            f"(it reported {', '.join(map(str, sorted(reported))) or 'none'})",
            field="devices",
        )
    return [reported[i] for i in sorted(indices)]


def do_enroll_agent(request: EnrollmentRequest, *, actor: Actor, **fields) -> Agent:
    """Approve a pending key: the agent `name` is that key from now on, with the
    pool and capabilities given (see clean_enrollment). Conflict when the request
    is not pending or the name belongs to another enrolled agent."""
    check_operator(actor)
    cleaned = clean_enrollment(request, fields)
    with transaction.atomic():
        request = EnrollmentRequest.objects.select_for_update().get(pk=request.pk)
        if request.state != "pending":
            raise Conflict(f"enrollment request {request.pk} is {request.state}")
        agent = Agent.objects.select_for_update().filter(name=cleaned["name"]).first()
        if agent is not None and agent.is_enrolled:
            raise Conflict(
                f"agent {agent.name} is enrolled under another key; revoke it first",
                field="name",
            )
        before = agent.to_dict() if agent else {}
        agent = agent or Agent(name=cleaned["name"])
        agent.queue = f"agent.{agent.name}"
        agent.enrollment = "enrolled"
        agent.public_key = request.public_key
        agent.fingerprint = request.fingerprint
        agent.pool_queue = cleaned["pool_queue"]
        agent.can_sign = cleaned["can_sign"]
        agent.allowed_programs = cleaned["allowed_programs"]
        agent.enrolled_devices = cleaned["devices"]
        agent.devices, agent.devices_outside_enrollment = [], []
        agent.signing_public_key = (
            request.signing_public_key if cleaned["can_sign"] else ""
        )
        agent.capabilities = agent.enrolled_capabilities()
        agent.enrolled_at = timezone.now()
        agent.state = "offline"  # online at its first beat
        agent.incarnation = ""
        agent.save()
        request.state, request.agent = "approved", agent
        request.save(update_fields=["state", "agent"])
        do_record_event(
            actor, "agent.enrolled", agent, before=before, after=agent.to_dict()
        )
    return agent


def do_enroll_local_agent(
    name: str,
    public_key: bytes,
    *,
    signing_public_key: str = "",
    pool_queue: str = "",
    actor: Actor = "system:dev",
) -> Agent:
    """Dev and demo only: enroll this machine's own agent without an operator
    (logged and audited as `actor`): the quick start's one agent, whose key the
    caller made on this machine. Production enrolls through an operator."""
    fingerprint = identity.fingerprint(public_key)
    agent = enrolled_agent(fingerprint)
    if agent is not None and agent.is_enrolled:
        return agent
    if agent is not None:  # revoked: a revocation is for good
        raise Conflict(
            f"the local agent's key was revoked (as {agent.name}): remove its "
            "identity key to make a new one"
        )
    log.warning(
        "dev: enrolling the local agent %s (key %s) without an operator",
        name,
        fingerprint,
    )
    with transaction.atomic():
        request, _ = EnrollmentRequest.objects.update_or_create(
            fingerprint=fingerprint,
            defaults={
                "public_key": public_key.hex(),
                "requested_name": name,
                "requested_pool": pool_queue,
                "signing_public_key": signing_public_key,
                "state": "pending",
            },
        )
        existing = Agent.objects.filter(name=name, enrollment="enrolled").first()
        if existing is not None:  # its key changed (the var dir was reset)
            do_revoke_agent(existing, actor=actor)
        return do_enroll_agent(
            request,
            actor=actor,
            name=name,
            pool_queue=pool_queue or settings.RELEASEGATE_AGENT_POOL_QUEUE,
            can_sign=bool(signing_public_key),
        )


def do_reject_enrollment(request: EnrollmentRequest, *, actor: Actor):
    check_operator(actor)
    with transaction.atomic():
        request = EnrollmentRequest.objects.select_for_update().get(pk=request.pk)
        if request.state != "pending":
            raise Conflict(f"enrollment request {request.pk} is {request.state}")
        request.state = "rejected"
        request.save(update_fields=["state"])
        do_record_event(
            actor, "agent.enrollment_rejected", request, after=request.to_dict()
        )
    return request


def do_revoke_agent(agent: Agent, *, actor: Actor) -> Agent:
    """The agent's key is refused from now on and it goes offline (the caller
    sends its jobs elsewhere: controlplane.releases.intake.revoke_agent)."""
    check_operator(actor)
    with transaction.atomic():
        agent = Agent.objects.select_for_update().get(pk=agent.pk)
        if agent.enrollment != "enrolled":
            raise Conflict(f"agent {agent.name} is not enrolled")
        before = {"enrollment": agent.enrollment, "state": agent.state}
        agent.enrollment, agent.state = "revoked", "offline"
        agent.save(update_fields=["enrollment", "state"])
        do_record_event(
            actor,
            "agent.revoked",
            agent,
            before=before,
            after={"enrollment": "revoked", "state": "offline"},
        )
    return agent


def do_record_message_refused(
    reason: str,
    *,
    type: str,
    signer: str = "",
    job_id: int | None = None,
    agent: Agent | None = None,
):
    """Audit a refused agent message (never silently dropped), bounded: per
    source (the enrolled agent whose key sealed it, else everyone unenrolled
    together: a forger picks any name and key) and kind of reason
    (`reason_class`), the first in each RELEASEGATE_REFUSAL_WINDOW_S is recorded
    in full and the rest counted, the count recorded as one
    `agent.messages_refused` event once the window has passed
    (controlplane.audit.actions.do_record_bounded_event). Returns the event
    written, or None when the refusal was only counted."""
    if agent is not None:
        actor = f"agent:{agent.name}"
    elif signer:
        actor = f"agent-key:{signer[:16]}"
    else:
        actor = "unauthenticated"
    obj = SimpleNamespace(
        _meta=SimpleNamespace(model_name="message"),
        pk=f"{type}:{job_id if job_id is not None else '-'}",
    )
    return do_record_bounded_event(
        actor,
        "agent.message_refused",
        obj,
        source=f"agent:{agent.name}" if agent is not None else "unenrolled",
        reason=f"{type}: {reason_class(reason)}",
        summary_verb="agent.messages_refused",
        after={
            "type": type,
            "job_id": job_id,
            "signer": signer,
            "agent": agent.name if agent else None,
            "reason": reason[:500],
        },
        window_s=settings.RELEASEGATE_REFUSAL_WINDOW_S,
        max_reasons=settings.RELEASEGATE_REFUSAL_REASONS_PER_WINDOW,
    )


def reason_class(reason: str) -> str:
    """What kind of refusal `reason` is, without what a message put in it: the
    words before the first colon, quoted values, numbers and hex strings
    replaced (so "stale: sealed +900 s from now" and "the seal binds job_id=3,
    the message 4" each stay one kind however many come)."""
    head = reason.split(":", 1)[0]
    head = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", head)
    head = re.sub(r"\b[0-9a-fA-F]{8,}\b", "…", head)
    head = re.sub(r"[+-]?\d+(\.\d+)?", "N", head)
    return head[:120]
