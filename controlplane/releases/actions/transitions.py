"""Every write to releases, jobs, gate results, approvals and deployments.

The release state machine lives here and only here: TRANSITIONS lists, for each state,
the states a release may move to. `do_transition_release` is the only code that
changes `Release.state`; it locks the row, checks the table, saves and writes an
AuditEvent in one transaction, so an illegal or failed transition changes nothing.

    registered        -> verifying, failed, rejected
    verifying         -> compressing, failed, failed_verification
    compressing       -> evaluating, failed
    evaluating        -> gated, failed
    gated             -> awaiting_approval, failed, rejected
                         (an inconclusive gate stays in gated: the pipeline pauses)
    awaiting_approval -> approved, rejected, failed, gated (re-measured)
    approved          -> deploying, failed
    deploying         -> live, failed, failed_verification (verify-on-load failed)
    live              -> superseded (a newer release went live), failed_verification
                         (periodic re-verification), rolled_back (operator rollback)
    superseded        -> deploying (rollback target; it stayed warm), quarantined
                         (its warm copy failed re-verification)
    rejected          -> registered (reopened for another review)
    failed            -> registered (retry the pipeline), gated (re-measured after
                         its gate failed)
    failed_verification -> quarantined (digest untrusted), rolled_back
    quarantined       -> registered (rebuild from source: a new candidate and digest)
    rolled_back       -> deploying (roll forward again; verify-on-load re-checks the
                         bytes), quarantined

No state is a dead end: every state has a way out, and every state is reachable from
registered (both are checked by tests over this table).
"""

from django.db import transaction
from django.utils import timezone

from controlplane.accounts.models import Team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import (
    IllegalTransition,
    ValidationFailed,
)
from controlplane.releases.models import (
    RELEASE_STATES,
    Release,
)
from controlplane.releases.sources import relative_to_source
from controlplane.webhooks.actions import do_queue_release_event

TRANSITIONS: dict[str, tuple[str, ...]] = {
    "registered": ("verifying", "failed", "rejected"),
    "verifying": ("compressing", "failed", "failed_verification"),
    "compressing": ("evaluating", "failed"),
    "evaluating": ("gated", "failed"),
    "gated": ("awaiting_approval", "failed", "rejected"),
    "awaiting_approval": ("approved", "rejected", "failed", "gated"),
    "approved": ("deploying", "failed"),
    "deploying": ("live", "failed", "failed_verification"),
    "live": ("superseded", "failed_verification", "rolled_back"),
    "superseded": ("deploying", "quarantined"),
    "rejected": ("registered",),
    "failed": ("registered", "gated"),
    "failed_verification": ("quarantined", "rolled_back"),
    "quarantined": ("registered",),
    "rolled_back": ("deploying", "quarantined"),
}


# Moving into these states needs a reason; it is kept in Release.failure_reason.
REASON_REQUIRED = ("failed", "failed_verification", "quarantined")


assert set(TRANSITIONS) == set(RELEASE_STATES)
assert all(t in RELEASE_STATES for targets in TRANSITIONS.values() for t in targets)


def legal_targets(state: str) -> tuple[str, ...]:
    return TRANSITIONS.get(state, ())


def do_transition_release(
    release: Release, to_state: str, *, actor: Actor, reason: str = ""
) -> Release:
    """Move `release` to `to_state` in one transaction with its audit event. Raises
    IllegalTransition (nothing changed) when the table does not allow it from the
    state the row has now. Updates and returns the given object."""
    if to_state not in RELEASE_STATES:
        raise ValidationFailed(f"unknown release state {to_state!r}", field="state")
    with transaction.atomic():
        locked = Release.objects.select_for_update().get(pk=release.pk)
        from_state = locked.state
        if to_state not in TRANSITIONS[from_state]:
            raise IllegalTransition(from_state, to_state, TRANSITIONS[from_state])
        if to_state in REASON_REQUIRED and not reason:
            raise ValidationFailed(
                f"moving a release to {to_state} needs a reason", field="reason"
            )
        earlier_reason = locked.failure_reason
        reason = relative_to_source(reason, locked.source_uri)
        locked.state = to_state
        locked.state_entered_at = timezone.now()
        if to_state == "registered":
            locked.reopened_at = locked.state_entered_at
        if from_state in REASON_REQUIRED and to_state in REASON_REQUIRED:
            # One incident in two steps (failed verification, then quarantined):
            # the first reason names the missing/extra/changed files; keep it.
            locked.failure_reason = f"{reason}; after {from_state}: {earlier_reason}"
        elif to_state in REASON_REQUIRED or (to_state == "rejected" and reason):
            locked.failure_reason = reason
        elif to_state == "registered":
            locked.failure_reason = ""
        locked.save(
            update_fields=[
                "state",
                "failure_reason",
                "state_entered_at",
                "reopened_at",
                "updated",
            ]
        )
        do_record_event(
            actor,
            "release.transition",
            locked,
            before={"state": from_state},
            after={"state": to_state, "reason": reason},
            team=Team.objects.get(model_families__releases=locked),
        )
        do_queue_release_event(locked, from_state, to_state, reason)
    for field in ("state", "failure_reason", "state_entered_at", "reopened_at"):
        setattr(release, field, getattr(locked, field))
    release.updated = locked.updated
    return release
