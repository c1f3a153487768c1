"""Approving and rejecting a release (bound to its manifest digest)."""

from django.db import transaction

from controlplane.accounts.actions import check_actor_in_team
from controlplane.accounts.models import ApiToken
from controlplane.audit.actions import do_record_event
from controlplane.dispatch.actions import do_enqueue_task
from controlplane.errors import (
    DigestMismatch,
    Forbidden,
    IllegalTransition,
    SeparationOfDuties,
    ValidationFailed,
)
from controlplane.releases.actions.promotion import RUN_DEPLOYMENT
from controlplane.releases.actions.transitions import (
    do_transition_release,
    legal_targets,
)
from controlplane.releases.models import (
    DECISIONS,
    Approval,
    Release,
)


def _check_approver(release: Release, user, token: ApiToken | None) -> None:
    """Raise unless `user` (through `token` when given) holds the approver or admin
    role in the release's team and, for a token, the approve scope."""
    if token is not None and token.user_id != user.pk:
        raise Forbidden("token and user do not match")
    check_actor_in_team(
        token or user, release.team, scope="approve", roles=("approver", "admin")
    )


def check_decide_release(
    release: Release, user, token: ApiToken | None = None, *, decision: str
) -> None:
    """Raise unless `user` (acting through `token` when given) may approve or
    reject `release`: approver or admin in its team, not the user or token that
    registered it (separation of duties holds both ways: a registrant can neither
    wave its release through nor take a colleague's review away), and the release
    in a state that decision leaves."""
    assert decision in DECISIONS
    _check_approver(release, user, token)
    if release.created_by_id == user.pk:
        raise SeparationOfDuties(
            f"{user.get_username()} registered {release} and cannot also {decision} it"
        )
    if token is not None and release.created_by_token_id == token.pk:
        raise SeparationOfDuties(
            f"token {token.name!r} registered {release} and cannot also {decision} it"
        )
    to_state = "approved" if decision == "approve" else "rejected"
    if decision == "approve":
        allowed = release.state == "awaiting_approval"
    else:
        allowed = to_state in legal_targets(release.state)
    if not allowed:
        raise IllegalTransition(release.state, to_state, legal_targets(release.state))


def check_approve_release(
    release: Release, user, token: ApiToken | None = None
) -> None:
    check_decide_release(release, user, token, decision="approve")


def do_approve_release(
    release: Release,
    user,
    *,
    token: ApiToken | None = None,
    comment: str = "",
    manifest_digest: str | None = None,
) -> Approval:
    """Approve; the approval records the manifest digest it is bound to. When the
    caller says which digest it reviewed (`manifest_digest`), it must be the current
    one, else DigestMismatch. Queues the deployment on commit."""
    release.refresh_from_db()
    check_approve_release(release, user, token)
    actor = token or user
    with transaction.atomic():
        # Hold the row from the digest check to the approval row: a manifest recorded
        # in between would otherwise go live under an approval of the old digest.
        release.refresh_from_db(from_queryset=Release.objects.select_for_update())
        if manifest_digest is not None and manifest_digest != release.manifest_digest:
            raise DigestMismatch(
                f"approval is for manifest {manifest_digest!r} but {release} has "
                f"{release.manifest_digest!r}",
                field="manifest_digest",
            )
        do_transition_release(release, "approved", actor=actor)
        approval = Approval.objects.create(
            release=release,
            user=user,
            token=token,
            decision="approve",
            comment=comment,
            manifest_digest=release.manifest_digest,
        )
        do_record_event(
            actor,
            "release.approved",
            release,
            after=approval.to_dict(),
            team=release.team,
        )
        do_enqueue_task(RUN_DEPLOYMENT, release.pk)
    return approval


def do_reject_release(
    release: Release, user, *, token: ApiToken | None = None, comment: str = ""
) -> Approval:
    """Reject with a reason (the comment, required), under the same rules as an
    approval: see check_decide_release."""
    release.refresh_from_db()
    check_decide_release(release, user, token, decision="reject")
    comment = comment.strip()
    if not comment:
        raise ValidationFailed("a rejection needs a reason", field="comment")
    actor = token or user
    with transaction.atomic():
        do_transition_release(release, "rejected", actor=actor, reason=comment)
        approval = Approval.objects.create(
            release=release,
            user=user,
            token=token,
            decision="reject",
            comment=comment,
            manifest_digest=release.manifest_digest,
        )
        do_record_event(
            actor,
            "release.rejected",
            release,
            after=approval.to_dict(),
            team=release.team,
        )
    return approval
