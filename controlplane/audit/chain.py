"""The audit log's hash chain (pure functions over an event's fields).

Each event stores `prev_hash`, the `event_hash` of the event written before it
(GENESIS for the first), and its own `event_hash`: sha256 over `prev_hash` and the
canonical JSON of its content (every field but the id and the hashes). Editing an
event changes its hash; deleting or reordering events breaks the link to the one
before; the chain head (AuditChainHead) names the last event, so removing the
newest ones shows too. Each event's `seq` is its position in the chain: events are
chained after their transactions commit (actions.chain_pending, under the head's
lock: each run takes what has committed, by id), so an event written earlier may
be chained later, and the chain is walked by seq, not id.

An event is unprotected between its commit and its chaining (moments, or until the
beat's chain_pending if its on-commit run was lost), and the chainer takes any
unchained row, so one inserted past the writer is chained like the rest. This
makes tampering evident, not impossible: whoever can rewrite every row and
the head can forge a new chain. Record the head hash somewhere else (the
verify_audit_chain command prints it) to pin the history up to then."""

import hashlib
import json
from datetime import UTC

GENESIS = "0" * 64

CONTENT_FIELDS = (
    "team_id",
    "actor_user_id",
    "actor_token_id",
    "actor_name",
    "verb",
    "object_type",
    "object_id",
    "before",
    "after",
    "created",
)


def as_stored(value: dict) -> dict:
    """`value` as a JSON column gives it back (tuples as lists, keys as strings),
    so the hash of an event written is the hash of the same event read."""
    return json.loads(json.dumps(value))


def canonical_content(event) -> bytes:
    """The fields the hash covers, as sorted, compact JSON (works on historical
    models in migrations too: it reads attributes only)."""
    content = {name: getattr(event, name) for name in CONTENT_FIELDS}
    content["created"] = event.created.astimezone(UTC).isoformat()
    return json.dumps(
        content, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


def event_hash(event, prev_hash: str) -> str:
    digest = hashlib.sha256(prev_hash.encode() + b"\n" + canonical_content(event))
    return digest.hexdigest()


def first_break(events, head_event_id: int | None, head_hash: str) -> str:
    """Why the chain of `events` (in seq order) does not hold, naming the first
    event that breaks it, or "" when it holds and ends where the head says."""
    prev_hash, last = GENESIS, None
    for event in events:
        if event.prev_hash != prev_hash:
            after = f"event {last.pk}" if last else "the start"
            return (
                f"event {event.pk} ({event.verb}) does not follow {after}: an "
                "event before it was deleted, reordered or changed"
            )
        if event.event_hash != event_hash(event, prev_hash):
            return f"event {event.pk} ({event.verb}) was changed after it was written"
        prev_hash, last = event.event_hash, event
    last_id = last.pk if last else None
    if (last_id, prev_hash) != (head_event_id, head_hash or GENESIS):
        return (
            f"the chain ends at event {last_id} but its head names event "
            f"{head_event_id}: newer events were deleted, or one was added past "
            "the log's writer"
        )
    return ""
