"""Approving and rejecting a release (bound to its manifest digest)."""

from django.db import transaction

from controlplane.accounts.actions import check_actor_in_team
from controlplane.accounts.models import APPROVER_ROLES, ApiToken
from controlplane.audit.actions import do_record_event
from controlplane.dispatch.actions import do_enqueue_task
from controlplane.errors import (
    DigestMismatch,
    Forbidden,
    GatesNoLongerPass,
    IllegalTransition,
    SeparationOfDuties,
    ValidationFailed,
)
from controlplane.releases.actions.gate_results import do_recheck_release_gates
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

# The state each decision moves a release to.
DECIDED = {"approve": "approved", "reject": "rejected"}


def _check_approver(release: Release, user, token: ApiToken | None) -> None:
    """Raise unless `user` (through `token` when given) holds an approver role in
    the release's team and, for a token, the approve scope."""
    if token is not None and token.user_id != user.pk:
        raise Forbidden("token and user do not match")
    check_actor_in_team(
        token or user, release.team, scope="approve", roles=APPROVER_ROLES
    )


def check_decide_release(
    release: Release,
    user,
    token: ApiToken | None = None,
    *,
    decision: str,
    manifest_digest: str | None = None,
) -> None:
    """Raise unless `user` (acting through `token` when given) may approve or
    reject `release` as it is now: approver or admin in its team, not the user or
    token that registered it (separation of duties holds both ways: a registrant
    can neither wave its release through nor take a colleague's review away), the
    release in a state that decision leaves, and, when the caller says which
    manifest it reviewed (`manifest_digest`), that manifest still the release's
    (else DigestMismatch). do_approve_release and do_reject_release run it again
    on the row they lock."""
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
    to_state = DECIDED[decision]
    if decision == "approve":
        allowed = release.state == "awaiting_approval"
    else:
        allowed = to_state in legal_targets(release.state)
    if not allowed:
        raise IllegalTransition(release.state, to_state, legal_targets(release.state))
    if manifest_digest is not None and manifest_digest != release.manifest_digest:
        noun = "approval" if decision == "approve" else "rejection"
        raise DigestMismatch(
            f"{noun} is for manifest {manifest_digest!r} but {release} has "
            f"{release.manifest_digest!r}: the manifest changed since it was "
            "reviewed; review it again",
            field="manifest_digest",
        )


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
    one, else DigestMismatch. The recorded evidence is held against the gate policy
    in force (do_recheck_release_gates: evaluated again when the policy changed
    since the gate ran); when it no longer passes, GatesNoLongerPass with the
    reason, the new results and a release.approval_refused event recorded, and the
    release stays awaiting approval. Queues the deployment on commit."""
    return _decide(
        release,
        user,
        token,
        decision="approve",
        comment=comment,
        manifest_digest=manifest_digest,
    )


def do_reject_release(
    release: Release,
    user,
    *,
    token: ApiToken | None = None,
    comment: str = "",
    manifest_digest: str | None = None,
) -> Approval:
    """Reject with a reason (the comment, required), under the same rules as an
    approval (check_decide_release), including the digest the caller reviewed."""
    comment = comment.strip()
    if not comment:
        check_decide_release(release, user, token, decision="reject")  # 403 first
        raise ValidationFailed("a rejection needs a reason", field="comment")
    return _decide(
        release,
        user,
        token,
        decision="reject",
        comment=comment,
        manifest_digest=manifest_digest,
    )


def _decide(
    release: Release,
    user,
    token: ApiToken | None,
    *,
    decision: str,
    comment: str,
    manifest_digest: str | None,
) -> Approval:
    actor = token or user
    with transaction.atomic():
        # Hold the row from the checks to the decision's row: a manifest recorded
        # in between would otherwise be decided on under the old digest's review.
        release.refresh_from_db(from_queryset=Release.objects.select_for_update())
        check_decide_release(
            release, user, token, decision=decision, manifest_digest=manifest_digest
        )
        refused = _gates_refusal(release, actor) if decision == "approve" else ""
        if not refused:
            approval = _record_decision(release, user, token, decision, comment)
    if refused:
        # Raised after the commit: the re-evaluation and the refusal stay recorded.
        raise GatesNoLongerPass(refused)
    return approval


def _gates_refusal(release: Release, actor) -> str:
    """Why the gate policy in force refuses approving `release` ("" when it
    doesn't); a refusal is recorded as release.approval_refused."""
    gates = do_recheck_release_gates(release, actor=actor)
    if gates is None or gates.ok:
        return ""
    refused = f"{release} cannot be approved: its gates no longer pass: {gates.reason}"
    do_record_event(
        actor,
        "release.approval_refused",
        release,
        after={"reason": refused, "outcome": gates.outcome},
        team=release.team,
    )
    return refused


def _record_decision(
    release: Release, user, token: ApiToken | None, decision: str, comment: str
) -> Approval:
    actor = token or user
    with transaction.atomic():
        reason = comment if decision == "reject" else ""
        do_transition_release(release, DECIDED[decision], actor=actor, reason=reason)
        approval = Approval.objects.create(
            release=release,
            user=user,
            token=token,
            decision=decision,
            comment=comment,
            manifest_digest=release.manifest_digest,
        )
        do_record_event(
            actor,
            f"release.{DECIDED[decision]}",
            release,
            after=approval.to_dict(),
            team=release.team,
        )
        if decision == "approve":
            do_enqueue_task(RUN_DEPLOYMENT, release.pk)
    return approval
