"""The one writer of AuditEvent rows. Callers run it inside their own transaction so
the event commits or rolls back with the change it describes.

Every event names who did it: a user (dashboard) by username, an API token as
`token:<prefix> (<name>, <username>)`, an agent as `agent:<name>` for what its
messages set off (the name the message carries: pass the enrolled identity that
signed it once messages are signed), or a named system component
("system:worker", "system:fleet") for what the control plane does on its own.
Each event is chained to the one before it by hash (chain.py), after its
transaction commits: do_record_event inserts it unchained and chain_pending, run on
commit in a short transaction of its own, gives it its place. A writer never waits
on the chain head while it holds other locks (waiting there did deadlock on
PostgreSQL: one transaction locked a job then waited for the head, another held the
head and waited for the job)."""

import logging
from contextlib import contextmanager
from contextvars import ContextVar

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from controlplane.accounts.models import ApiToken
from controlplane.audit import chain
from controlplane.audit.models import AuditChainHead, AuditEvent

logger = logging.getLogger(__name__)

# Who did something: a user (dashboard), a token (API), or a named system component
# ("system:worker"). None means the system without a finer name.
Actor = AbstractBaseUser | ApiToken | str | None

# The agent whose message (a result, a progress report, a heartbeat) is being
# recorded, if any: what the worker does in answer names it.
_acting_agent: ContextVar[str | None] = ContextVar("acting_agent", default=None)
# What the worker and agent bookkeeping name themselves; a named policy
# ("system:auto-rollback", "system:fleet") keeps its own name.
WORKER_ACTORS = (None, "system", "system:worker", "system:agent")


def agent_actor_name(agent_name: str) -> str:
    return f"agent:{agent_name}"


@contextmanager
def on_behalf_of_agent(agent_name: str | None):
    """Within this block, events the worker records (WORKER_ACTORS) name the agent
    `agent_name` instead: it is the party whose message set them off. Events by a
    user, a token or a named policy keep their actor."""
    token = _acting_agent.set(agent_name or None)
    try:
        yield
    finally:
        _acting_agent.reset(token)


def actor_fields(actor: Actor) -> dict:
    if isinstance(actor, ApiToken):
        return {
            "actor_user": actor.user,
            "actor_token": actor,
            "actor_name": actor.actor_name,
        }
    if isinstance(actor, AbstractBaseUser):
        return {"actor_user": actor, "actor_name": actor.get_username()}
    agent = _acting_agent.get()
    if agent and actor in WORKER_ACTORS:
        return {"actor_name": agent_actor_name(agent)}
    return {"actor_name": actor or "system"}


def do_record_event(
    actor: Actor,
    verb: str,
    obj,
    *,
    before: dict | None = None,
    after: dict | None = None,
    team=None,
) -> AuditEvent:
    """Insert the event, unchained, in the caller's transaction; it is chained
    once that commits (an event whose transaction rolls back never existed, so it
    leaves no hole in the chain). Outside a transaction it is chained at once."""
    event = AuditEvent(
        team=team,
        verb=verb,
        object_type=obj._meta.model_name,
        object_id=str(obj.pk),
        before=chain.as_stored(before or {}),
        after=chain.as_stored(after or {}),
        **actor_fields(actor),
    )
    event.save()
    # robust: the event is committed whatever happens here; one left unchained is
    # chained by the next run (another commit, the beat, verify_audit_chain).
    transaction.on_commit(chain_pending, robust=True)
    return event


def chain_pending() -> int:
    """Chain every committed, unchained event, oldest id first, in one short
    transaction of its own under the head's lock, so chainers take turns and each
    event is chained once. Idempotent: with nothing pending it changes nothing.
    Run on each commit that wrote events, by the beat and by verify_audit_chain (so
    an event whose on-commit run was lost, the process killed right after its
    commit, is chained later). Returns how many events it chained."""
    with transaction.atomic():
        head, _ = AuditChainHead.objects.select_for_update().get_or_create(pk=1)
        # Read after the lock: a chainer before us has committed what it chained.
        pending = list(AuditEvent.objects.filter(seq__isnull=True).order_by("id"))
        seq, prev_hash = head.last_seq, head.last_hash or chain.GENESIS
        for event in pending:
            seq += 1
            event_hash = chain.event_hash(event, prev_hash)
            linked = AuditEvent.objects.link(
                event.pk, seq=seq, prev_hash=prev_hash, event_hash=event_hash
            )
            if linked != 1:  # removed past the writer: chain nothing this time
                raise RuntimeError(f"audit event {event.pk} vanished while chaining")
            head.last_event_id, prev_hash = event.pk, event_hash
        if pending:
            head.last_seq, head.last_hash = seq, prev_hash
            head.save(update_fields=["last_event_id", "last_seq", "last_hash"])
    if pending:
        logger.debug("chained %d audit events, up to seq %d", len(pending), seq)
    return len(pending)
