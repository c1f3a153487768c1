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
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from controlplane.accounts.models import ApiToken
from controlplane.audit import chain
from controlplane.audit.models import AuditChainHead, AuditEvent, EventWindow

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


# Where a source's reasons in one window pass the cap: counted together.
OTHER_REASONS = "(other reasons)"


def window_start(now: datetime, window_s: float) -> datetime:
    """The start of the `window_s`-long window `now` falls in (windows are laid
    from the Unix epoch, so every process agrees on them)."""
    seconds = now.timestamp()
    return datetime.fromtimestamp(seconds - seconds % window_s, tz=UTC)


def do_record_bounded_event(
    actor: Actor,
    verb: str,
    obj,
    *,
    source: str,
    reason: str,
    summary_verb: str,
    after: dict,
    window_s: float,
    max_reasons: int,
) -> AuditEvent | None:
    """Record an event that may come in a flood: the first of `verb` from
    `source` for `reason` in this window (`window_s`) in full, as do_record_event
    would, and every later one only as a count (EventWindow); the count is
    recorded (`summary_verb`) once the window has passed. A source's reasons
    past `max_reasons` in one window are counted together (OTHER_REASONS), so
    a source that varies its reason gains nothing. `source` and `reason` must
    come from a bounded set (an enrolled identity, not a name a message gives
    itself). Returns the event written, or None when it was only counted. Closes
    the windows that have passed (do_close_event_windows) first."""
    now = timezone.now()
    start = window_start(now, window_s)
    reason, source = reason[:200], source[:200]
    do_close_event_windows(now=now)
    with transaction.atomic():
        windows = EventWindow.objects.filter(
            verb=verb, source=source, window_start=start
        )
        if (
            not windows.filter(reason=reason).exists()
            and windows.count() >= max_reasons
        ):
            reason = OTHER_REASONS
        if _count(windows.filter(reason=reason), now):
            return None
        try:
            with transaction.atomic():
                window = EventWindow.objects.create(
                    verb=verb,
                    summary_verb=summary_verb,
                    source=source,
                    reason=reason,
                    window_start=start,
                    window_s=window_s,
                    last_seen=now,
                )
        except IntegrityError:  # another writer opened it meanwhile
            _count(windows.filter(reason=reason), now)
            return None
        event = do_record_event(
            actor,
            verb,
            obj,
            after={
                **after,
                "window": {
                    "source": source,
                    "reason": reason,
                    "start": start.isoformat(),
                    "seconds": window_s,
                },
            },
        )
        EventWindow.objects.filter(pk=window.pk).update(first_event=event)
    return event


def _count(windows, now: datetime) -> bool:
    return bool(windows.update(count=F("count") + 1, last_seen=now))


def do_close_event_windows(*, now: datetime | None = None) -> int:
    """Record the count of every window that has passed by `now` (default: now)
    and more than its first event came in: one event each (its summary verb,
    naming the first event), in the same transaction as the window's removal,
    so each count is recorded once. Returns how many were recorded."""
    now = now or timezone.now()
    recorded = 0
    started = EventWindow.objects.filter(window_start__lt=now).order_by("id")
    for window_id, start, window_s in started.values_list(
        "id", "window_start", "window_s"
    ):
        if start + timedelta(seconds=window_s) > now:
            continue  # still open
        with transaction.atomic():
            window = (
                EventWindow.objects.select_for_update(skip_locked=True)
                .filter(pk=window_id)
                .first()
            )
            if window is None:
                continue  # another closer has it
            end = window.window_start + timedelta(seconds=window.window_s)
            if window.count > 1:
                do_record_event(
                    "system:audit",
                    window.summary_verb,
                    SimpleNamespace(
                        _meta=SimpleNamespace(model_name="eventwindow"),
                        pk=window.first_event_id,
                    ),
                    after={
                        "verb": window.verb,
                        "source": window.source,
                        "reason": window.reason,
                        "window_start": window.window_start.isoformat(),
                        "window_end": end.isoformat(),
                        "count": window.count,
                        "first_event": window.first_event_id,
                        "last_seen": window.last_seen.isoformat(),
                    },
                )
                recorded += 1
            window.delete()
    return recorded
