"""Asking for promotion, and reopening a rejected or failed release."""

from django.db import transaction

from controlplane.accounts.actions import check_actor_in_team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.dispatch.actions import do_enqueue_task
from controlplane.errors import (
    Conflict,
    ValidationFailed,
)
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Release

# The tasks a write queues (by name, through the outbox: controlplane.dispatch).
RUN_PROMOTION = "controlplane.releases.run_promotion"


RUN_DEPLOYMENT = "controlplane.releases.run_deployment"


# States in which the promotion pipeline owns the release and may (re)start.
PIPELINE_STATES = ("registered", "verifying", "compressing", "evaluating", "gated")


# States in which the deployment task owns the release. An approval whose deployment
# was never queued (broker down at commit) or whose task died is resumed by a promote.
DEPLOYMENT_PIPELINE_STATES = ("approved", "deploying")


def do_request_promotion(release: Release, actor: Actor) -> Release:
    """Queue the promotion pipeline for `release` through the outbox. A
    failed release is moved back to registered first (a retry); a release already in
    the pipeline is queued again, which is harmless because the task is idempotent.
    An approved or deploying release gets its (idempotent) deployment task again:
    its approval stands, so this only resumes what the approval started."""
    check_actor_in_team(actor, release.team, scope="promote")
    with transaction.atomic():
        release.refresh_from_db(fields=["state"])
        if release.state == "failed":
            do_transition_release(
                release, "registered", actor=actor, reason="promotion retried"
            )
        if release.state in PIPELINE_STATES:
            task_name = RUN_PROMOTION
        elif release.state in DEPLOYMENT_PIPELINE_STATES:
            task_name = RUN_DEPLOYMENT
        else:
            resumable = (*PIPELINE_STATES, *DEPLOYMENT_PIPELINE_STATES)
            raise Conflict(
                f"release {release} is {release.state}; only a release in "
                f"{', '.join(resumable)} or failed can be promoted"
                + NEXT_STEP.get(release.state, "")
            )
        do_record_event(
            actor,
            "release.promotion_requested",
            release,
            after={"state": release.state},
            team=release.team,
        )
        do_enqueue_task(task_name, release.pk)
    return release


# What a user does next with a release that can't be promoted.
NEXT_STEP = {
    "rejected": "; reopen it for another review (POST .../reopen with a reason) "
    "or register a new version",
    "quarantined": "; its digest is untrusted: register a new version",
}


REOPENABLE_STATES = ("rejected", "failed")


def do_reopen_release(release: Release, actor: Actor, *, reason: str) -> Release:
    """rejected or failed -> registered, so that a promote runs the whole pipeline
    again and the result needs a new approval (approvals made before are no longer
    in force). The reason is required; the earlier failure reason stays in the
    audit log and the rejection in the approvals."""
    check_actor_in_team(actor, release.team, scope="promote")
    reason = reason.strip()
    if not reason:
        raise ValidationFailed("reopening needs a reason", field="reason")
    with transaction.atomic():
        release.refresh_from_db(from_queryset=Release.objects.select_for_update())
        _check_reopenable(release)
        before = {"state": release.state, "failure_reason": release.failure_reason}
        do_transition_release(release, "registered", actor=actor, reason=reason)
        do_record_event(
            actor,
            "release.reopened",
            release,
            before=before,
            after={"state": release.state, "reason": reason},
            team=release.team,
        )
    return release


def check_reopen_release(release: Release, actor: Actor) -> None:
    """Raise as do_reopen_release would, before it is asked to (the dashboard's
    confirmation step): not allowed to (Forbidden: any member of the team may),
    or not rejected or failed (Conflict)."""
    check_actor_in_team(actor, release.team, scope="promote")
    _check_reopenable(release)


def _check_reopenable(release: Release) -> None:
    if release.state not in REOPENABLE_STATES:
        raise Conflict(
            f"release {release} is {release.state}; only a rejected or failed "
            "release can be reopened" + NEXT_STEP.get(release.state, "")
        )
