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
    awaiting_approval -> approved, rejected, failed
    approved          -> deploying, failed
    deploying         -> live, failed, failed_verification (verify-on-load failed)
    live              -> superseded (a newer release went live), failed_verification
                         (periodic re-verification), rolled_back (operator rollback)
    superseded        -> deploying (rollback target; it stayed warm), quarantined
                         (its warm copy failed re-verification)
    rejected          -> registered (reopened for another review)
    failed            -> registered (retry the pipeline)
    failed_verification -> quarantined (digest untrusted), rolled_back
    quarantined       -> registered (rebuild from source: a new candidate and digest)
    rolled_back       -> deploying (roll forward again; verify-on-load re-checks the
                         bytes), quarantined

No state is a dead end: every state has a way out, and every state is reachable from
registered (both are checked by tests over this table).
"""

import hashlib
import json
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from pydantic import ValidationError

from controlplane.accounts.actions import (
    check_actor_in_team,
    team_source_roots,
    user_of,
)
from controlplane.accounts.models import ApiToken, Team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.audit.models import AuditEvent
from controlplane.dispatch.actions import do_enqueue_task
from controlplane.errors import (
    Conflict,
    ConflictingRegistration,
    DigestMismatch,
    Forbidden,
    IllegalTransition,
    JobLeaseHeld,
    SeparationOfDuties,
    ValidationFailed,
    validation_failed,
)
from controlplane.fleet.models import Agent, Deployment, Environment
from controlplane.releases.gates import (
    GateDecision,
    GatePolicy,
    evaluate_gates,
    evaluate_policy,
)
from controlplane.releases.models import (
    DECISIONS,
    GATE_OUTCOMES,
    JOB_STATES,
    RELEASE_STATES,
    Approval,
    Artifact,
    EnvironmentGatePolicy,
    GateResult,
    Job,
    ModelFamily,
    Release,
)
from controlplane.releases.sources import (
    SourceRefused,
    relative_to_source,
    resolve_source,
)
from controlplane.webhooks.actions import do_queue_release_event
from gpuagent.protocol import (
    JOB_KINDS,
    FileDigest,
    LoadTestReport,
    QualityReport,
    Recipe,
)

TRANSITIONS: dict[str, tuple[str, ...]] = {
    "registered": ("verifying", "failed", "rejected"),
    "verifying": ("compressing", "failed", "failed_verification"),
    "compressing": ("evaluating", "failed"),
    "evaluating": ("gated", "failed"),
    "gated": ("awaiting_approval", "failed", "rejected"),
    "awaiting_approval": ("approved", "rejected", "failed"),
    "approved": ("deploying", "failed"),
    "deploying": ("live", "failed", "failed_verification"),
    "live": ("superseded", "failed_verification", "rolled_back"),
    "superseded": ("deploying", "quarantined"),
    "rejected": ("registered",),
    "failed": ("registered",),
    "failed_verification": ("quarantined", "rolled_back"),
    "quarantined": ("registered",),
    "rolled_back": ("deploying", "quarantined"),
}
# Moving into these states needs a reason; it is kept in Release.failure_reason.
REASON_REQUIRED = ("failed", "failed_verification", "quarantined")
# The tasks a write queues (by name, through the outbox: controlplane.dispatch).
RUN_PROMOTION = "controlplane.releases.run_promotion"
RUN_DEPLOYMENT = "controlplane.releases.run_deployment"
# States in which the promotion pipeline owns the release and may (re)start.
PIPELINE_STATES = ("registered", "verifying", "compressing", "evaluating", "gated")
# States in which the deployment task owns the release. An approval whose deployment
# was never queued (broker down at commit) or whose task died is resumed by a promote.
DEPLOYMENT_PIPELINE_STATES = ("approved", "deploying")

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
        if from_state in REASON_REQUIRED and to_state in REASON_REQUIRED:
            # One incident in two steps (failed verification, then quarantined):
            # the first reason names the missing/extra/changed files; keep it.
            locked.failure_reason = f"{reason}; after {from_state}: {earlier_reason}"
        elif to_state in REASON_REQUIRED or (to_state == "rejected" and reason):
            locked.failure_reason = reason
        elif to_state == "registered":
            locked.failure_reason = ""
        locked.save(update_fields=["state", "failure_reason", "updated"])
        do_record_event(
            actor,
            "release.transition",
            locked,
            before={"state": from_state},
            after={"state": to_state, "reason": reason},
            team=Team.objects.get(model_families__releases=locked),
        )
        do_queue_release_event(locked, from_state, to_state, reason)
    release.state = locked.state
    release.failure_reason = locked.failure_reason
    release.updated = locked.updated
    return release


# -- model families and environments -------------------------------------------------


def do_create_model_family(
    team: Team, name: str, *, actor: Actor, description: str = ""
) -> ModelFamily:
    check_actor_in_team(actor, team, scope="register")
    name = name.strip()
    if not name:
        raise ValidationFailed("name must not be empty", field="name")
    try:
        with transaction.atomic():
            family = ModelFamily.objects.create(
                team=team, name=name, description=description
            )
            do_record_event(
                actor, "model.created", family, after=family.to_dict(), team=team
            )
    except IntegrityError as exc:
        raise Conflict(
            f"model {name!r} already exists in team {team.slug}", field="name"
        ) from exc
    return family


def do_create_environment(team: Team, name: str, *, actor: Actor) -> Environment:
    check_actor_in_team(actor, team, roles=("admin",))
    try:
        with transaction.atomic():
            environment = Environment.objects.create(team=team, name=name)
            do_record_event(
                actor,
                "environment.created",
                environment,
                after=environment.to_dict(),
                team=team,
            )
    except IntegrityError as exc:
        raise Conflict(
            f"environment {name!r} already exists in team {team.slug}", field="name"
        ) from exc
    return environment


# -- registration ---------------------------------------------------------------------


def registration_body_digest(
    family: ModelFamily,
    *,
    version: str,
    source_uri: str,
    recipe: dict,
    target_environment: Environment,
    parent: Release | None,
) -> str:
    body = {
        "model": family.name,
        "version": version,
        "source_uri": source_uri,
        "recipe": recipe,
        "target_environment": target_environment.name,
        "parent": parent.pk if parent else None,
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _validated_recipe(recipe: dict) -> dict:
    try:
        return Recipe.model_validate(recipe).model_dump(exclude_defaults=True)
    except ValidationError as exc:
        raise validation_failed(exc, "recipe") from exc


def check_source_uri(team: Team, source_uri: str) -> None:
    """ValidationFailed (on source_uri) unless the URI names a folder inside one of
    `team`'s source roots, reached without symlinks or '..' (see sources.py)."""
    try:
        resolve_source(source_uri, team_source_roots(team))
    except SourceRefused as exc:
        raise ValidationFailed(str(exc), field="source_uri") from exc


def do_register_release(
    model_family: ModelFamily,
    *,
    version: str,
    source_uri: str,
    recipe: dict,
    target_environment: Environment,
    actor: Actor,
    parent: Release | None = None,
) -> tuple[Release, bool]:
    """Register a release; returns (release, created). Registering the same body
    again returns the existing release with created=False; a different body for the
    same model and version raises ConflictingRegistration."""
    team = model_family.team
    check_actor_in_team(actor, team, scope="register")
    version = version.strip()
    if not version or len(version) > 100:
        raise ValidationFailed("version must be 1..100 characters", field="version")
    if not source_uri.strip():
        raise ValidationFailed("source_uri must not be empty", field="source_uri")
    check_source_uri(team, source_uri)
    if target_environment.team_id != team.id:
        raise ValidationFailed(
            f"environment {target_environment.name!r} is not in team {team.slug}",
            field="target_environment",
        )
    if parent is not None and parent.model.team_id != team.id:
        raise ValidationFailed("parent release is in another team", field="parent")
    recipe = _validated_recipe(recipe)
    digest = registration_body_digest(
        model_family,
        version=version,
        source_uri=source_uri,
        recipe=recipe,
        target_environment=target_environment,
        parent=parent,
    )

    def existing_or_conflict(existing: Release) -> tuple[Release, bool]:
        if existing.registration_body_digest != digest:
            raise ConflictingRegistration(
                f"{model_family.name}@{version} is already registered with a "
                "different body"
            )
        return existing, False

    existing = Release.objects.filter(model=model_family, version=version).first()
    if existing is not None:
        return existing_or_conflict(existing)
    try:
        with transaction.atomic():
            release = Release.objects.create(
                model=model_family,
                version=version,
                source_uri=source_uri,
                recipe=recipe,
                target_environment=target_environment,
                parent=parent,
                created_by=user_of(actor),
                created_by_token=actor if isinstance(actor, ApiToken) else None,
                registration_body_digest=digest,
            )
            do_record_event(
                actor, "release.registered", release, after=release.to_dict(), team=team
            )
    except IntegrityError:
        # A concurrent registration of the same model+version won the race.
        return existing_or_conflict(
            Release.objects.get(model=model_family, version=version)
        )
    return release, True


# -- promotion, approval, deployment --------------------------------------------------


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


def _last_reopened(release: Release) -> datetime | None:
    """When `release` last moved back to registered (None: never)."""
    return (
        AuditEvent.objects.filter(
            verb="release.transition",
            object_type="release",
            object_id=str(release.pk),
            after__state="registered",
        )
        .order_by("-created", "-id")
        .values_list("created", flat=True)
        .first()
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


def do_start_deployment(
    release: Release,
    *,
    actor: Actor,
    environment: Environment | None = None,
    agent: Agent | None = None,
) -> Deployment:
    """approved/superseded/rolled_back -> deploying, with a Deployment row."""
    environment = environment or release.target_environment
    with transaction.atomic():
        do_transition_release(release, "deploying", actor=actor)
        deployment = Deployment.objects.create(
            release=release, environment=environment, agent=agent, state="deploying"
        )
        do_record_event(
            actor,
            "deployment.started",
            deployment,
            after=deployment.to_dict(),
            team=environment.team,
        )
    return deployment


def do_complete_deployment(
    deployment: Deployment,
    *,
    actor: Actor,
    endpoint: str = "",
    agent: Agent | None = None,
    serving_id: str = "",
) -> Deployment:
    """deploying -> live; whatever was live in the environment becomes superseded
    (and stays warm as the rollback target)."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if deployment.state != "deploying":
            raise Conflict(f"deployment {deployment.pk} is {deployment.state}")
        now = timezone.now()
        previous = (
            Deployment.objects.select_for_update()
            .serving()
            .filter(environment=deployment.environment)
            .exclude(pk=deployment.pk)
        )
        for old in previous:
            # One that failed verification keeps its state (it is no rollback
            # target) but is no longer what the environment serves.
            if old.state == "live":
                old.state = "superseded"
            old.ended = now
            old.save(update_fields=["state", "ended"])
            if old.release.state == "live":
                do_transition_release(old.release, "superseded", actor=actor)
        deployment.state = "live"
        deployment.endpoint = endpoint or deployment.endpoint
        deployment.agent = agent or deployment.agent
        deployment.serving_id = serving_id or deployment.serving_id
        deployment.save(update_fields=["state", "endpoint", "agent", "serving_id"])
        do_transition_release(deployment.release, "live", actor=actor)
        do_record_event(
            actor,
            "deployment.live",
            deployment,
            before={"state": "deploying"},
            after=deployment.to_dict(),
            team=deployment.environment.team,
        )
    return deployment


def do_fail_deployment(
    deployment: Deployment, *, actor: Actor, reason: str, verification: bool = False
) -> Deployment:
    """Mark a deploying or live deployment failed (or failed_verification when the
    bytes did not match) and move its release along."""
    new_state = "failed_verification" if verification else "failed"
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        before = deployment.state
        if before not in ("deploying", "live"):
            raise Conflict(f"deployment {deployment.pk} is {before}")
        deployment.state = new_state
        deployment.reason = reason
        if new_state == "failed":
            deployment.ended = timezone.now()
        deployment.save(update_fields=["state", "ended", "reason"])
        do_transition_release(deployment.release, new_state, actor=actor, reason=reason)
        do_record_event(
            actor,
            f"deployment.{new_state}",
            deployment,
            before={"state": before},
            after={"state": new_state, "reason": reason},
            team=deployment.environment.team,
        )
    return deployment


def previous_verified_deployment(
    environment: Environment, exclude_release_id: int | None = None
) -> Deployment | None:
    """The newest release a rollback of `environment` may go to, or None: the
    newest superseded deployment whose release is still superseded (it went live,
    verified on load, and has not failed verification or been quarantined since).
    Whether its copy still verifies is the agent's to say when the rollback's
    deploy job re-hashes it; when it doesn't, the release is quarantined and the
    next call finds the one before it."""
    return (
        environment.deployments.filter(state="superseded", release__state="superseded")
        .exclude(release_id=exclude_release_id)
        .select_related("release", "release__model")
        .order_by("-started", "-id")
        .first()
    )


def do_rollback_environment(
    environment: Environment, actor: Actor, *, reason: str = ""
) -> Deployment:
    """Replace what is live (or failed verification) in `environment` with its
    previous verified release. The current release becomes rolled_back, or
    quarantined when it failed verification. Returns the new deploying Deployment;
    the deployment task finishes it on commit (and, should its copy no longer
    verify, do_continue_rollback tries the next older candidate)."""
    check_actor_in_team(
        actor, environment.team, scope="promote", roles=("approver", "admin")
    )
    return _roll_back(environment, actor, reason=reason)


def do_auto_rollback_environment(
    environment: Environment, *, reason: str, actor: Actor = "system:auto-rollback"
) -> Deployment | None:
    """The rollback an environment's policy (auto_rollback_on_failed_verification)
    starts by itself after a failed re-verification: the same as an operator's,
    recorded as done by the system with `reason`. None when it is not possible
    (the refusal is recorded as environment.auto_rollback_refused)."""
    try:
        return _roll_back(environment, actor, reason=reason)
    except Conflict as exc:
        do_record_event(
            actor,
            "environment.auto_rollback_refused",
            environment,
            after={"reason": reason, "refused": exc.message},
            team=environment.team,
        )
        return None


def _roll_back(environment: Environment, actor: Actor, *, reason: str) -> Deployment:
    with transaction.atomic():
        current = (
            Deployment.objects.select_for_update()
            .serving()
            .filter(environment=environment)
            .order_by("-started", "-id")
            .first()
        )
        if current is None:
            raise Conflict(f"nothing is live in {environment} to roll back")
        target = previous_verified_deployment(environment, current.release_id)
        if target is None:
            raise Conflict(
                f"{environment} has no previous verified release to roll back to"
            )
        release = current.release
        if release.state == "failed_verification":
            do_transition_release(
                release,
                "quarantined",
                actor=actor,
                reason=f"rolled back in {environment.name} after failed verification",
            )
        else:
            do_transition_release(release, "rolled_back", actor=actor)
        before = current.state
        current.state = "rolled_back"
        current.ended = timezone.now()
        current.save(update_fields=["state", "ended"])
        deployment = _start_rollback_deployment(target, environment, actor, tried=[])
        after = {"release_id": target.release_id, "deployment_id": deployment.pk}
        do_record_event(
            actor,
            "environment.rolled_back",
            environment,
            before={"release_id": release.pk, "deployment_state": before},
            after={**after, "reason": reason} if reason else after,
            team=environment.team,
        )
    return deployment


def _start_rollback_deployment(
    target: Deployment, environment: Environment, actor: Actor, *, tried: list[str]
) -> Deployment:
    deployment = do_start_deployment(
        target.release, actor=actor, environment=environment, agent=target.agent
    )
    deployment.endpoint = target.endpoint
    deployment.rollback_tried = tried
    deployment.save(update_fields=["endpoint", "rollback_tried"])
    do_enqueue_task(RUN_DEPLOYMENT, target.release_id)
    return deployment


def do_continue_rollback(
    deployment: Deployment, *, why: str, actor: Actor = "system:worker"
) -> Deployment | None:
    """A rollback's deploy failed (`deployment`, already failed by
    do_fail_deployment, with `why`): its release is no rollback target any more
    (quarantined when its copy failed verification); go to the next older
    candidate, up to RELEASEGATE_ROLLBACK_MAX_CANDIDATES in all. When none
    remains, the rollback ends: the deployment's reason names every release tried
    and why. Returns the next deploying Deployment, or None."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        environment = deployment.environment
        release = deployment.release
        deployment.ended = deployment.ended or timezone.now()
        tried = [*(deployment.rollback_tried or []), f"{release} ({why})"]
        if release.state == "failed_verification":
            do_transition_release(
                release,
                "quarantined",
                actor=actor,
                reason=f"rollback target in {environment.name} failed verification",
            )
        target = previous_verified_deployment(environment)
        limit = settings.RELEASEGATE_ROLLBACK_MAX_CANDIDATES
        if target is not None and len(tried) < limit:
            deployment.save(update_fields=["ended"])
            following = _start_rollback_deployment(
                target, environment, actor, tried=tried
            )
            do_record_event(
                actor,
                "environment.rollback_continued",
                environment,
                before={"release_id": release.pk, "reason": why},
                after={"release_id": target.release_id, "deployment_id": following.pk},
                team=environment.team,
            )
            return following
        more = " (gave up after {limit} candidates)" if target is not None else ""
        deployment.reason = (
            f"no previous release of {environment.name} still verifies: "
            + ", ".join(tried)
            + more.format(limit=limit)
        )
        deployment.save(update_fields=["ended", "reason"])
        do_record_event(
            actor,
            "environment.rollback_failed",
            environment,
            after={"reason": deployment.reason, "deployment_id": deployment.pk},
            team=environment.team,
        )
    return None


# -- jobs, gate results, artifacts ----------------------------------------------------


def _lease_until(now: datetime) -> datetime:
    return now + timedelta(seconds=settings.RELEASEGATE_JOB_LEASE_S)


def do_start_job(release: Release, kind: str, *, agent: Agent | None = None) -> Job:
    """Start a stage's job, leased to the caller for RELEASEGATE_JOB_LEASE_S. A job
    of the same kind still queued, or running with an expired lease (its worker
    died), is resumed with attempts + 1 instead of adding another row. One running
    under a live lease raises JobLeaseHeld and is left as it is: its worker is
    still at it, and a second run of the same work must not start."""
    if kind not in JOB_KINDS:
        raise ValidationFailed(f"unknown job kind {kind!r}", field="kind")
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .filter(release=release, kind=kind, state__in=("queued", "running"))
            .order_by("-id")
            .first()
        )
        now = timezone.now()
        if job is None:
            job = Job(release=release, kind=kind)
        elif job.state == "running" and job.lease_expires and job.lease_expires > now:
            raise JobLeaseHeld(job.pk, kind, job.lease_expires)
        job.state = "running"
        job.agent = agent or job.agent
        job.attempts += 1
        job.progress = 0.0
        job.started = now
        job.finished = None
        job.lease_expires = _lease_until(now)
        job.error = ""
        job.save()
    return job


def do_dispatch_job(release: Release, kind: str) -> Job:
    """A new job for an agent, queued (attempt 1); the caller sends its request."""
    if kind not in JOB_KINDS:
        raise ValidationFailed(f"unknown job kind {kind!r}", field="kind")
    # Until when an agent must have taken it (pipeline.watch_jobs retries it then).
    deadline = timezone.now() + timedelta(
        seconds=settings.RELEASEGATE_JOB_QUEUE_TIMEOUT_S
    )
    return Job.objects.create(
        release=release, kind=kind, state="queued", attempts=1, lease_expires=deadline
    )


def do_mark_job_running(job: Job, *, attempt: int, agent: Agent, progress: float):
    """An agent reports it runs `attempt` of `job` (progress in 0..1). False, and
    nothing changed, for a finished job or an attempt no longer in force."""
    progress = min(max(progress, 0.0), 1.0)
    now = timezone.now()
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.state not in ("queued", "running") or locked.attempts != attempt:
            return False
        if locked.state == "queued":  # taken now: the time limit starts
            locked.started = now
            locked.lease_expires = now + timedelta(
                seconds=settings.RELEASEGATE_JOB_TIME_LIMIT_S
            )
        locked.state = "running"
        locked.agent = agent
        locked.progress = progress
        locked.save(
            update_fields=["state", "agent", "progress", "started", "lease_expires"]
        )
    return True


def do_retry_job(job: Job, *, reason: str) -> Job:
    """Send `job` again (attempt + 1) after its agent went silent: the result of
    the earlier attempt, should it still come, no longer counts."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        before = locked.to_dict()
        locked.attempts += 1
        locked.state = "queued"
        locked.agent = None
        locked.progress = 0.0
        locked.started = None
        locked.lease_expires = timezone.now() + timedelta(
            seconds=settings.RELEASEGATE_JOB_QUEUE_TIMEOUT_S
        )
        locked.error = reason
        locked.save()
        do_record_event(
            "system:worker",
            "job.retried",
            locked,
            before={"attempts": before["attempts"], "agent": before["agent"]},
            after={"attempts": locked.attempts, "reason": reason},
            team=locked.release.team,
        )
    job.refresh_from_db()
    return job


def do_update_job_progress(job: Job, progress: float) -> Job:
    """Record progress; for a running job this is also the heartbeat that extends
    its lease, so a stage longer than one lease keeps its job."""
    if not 0.0 <= progress <= 1.0:
        raise ValidationFailed("progress must be within 0..1", field="progress")
    if not _renew_lease(job, progress=progress):  # queued or finished: no lease
        Job.objects.filter(pk=job.pk).update(progress=progress)
    job.progress = progress
    return job


def do_renew_job_lease(job: Job) -> bool:
    """Extend a running job's lease by RELEASEGATE_JOB_LEASE_S from now (the
    heartbeat of a stage at work); False when the job is no longer running."""
    return _renew_lease(job)


def _renew_lease(job: Job, **fields) -> bool:
    """One UPDATE of a running job: its lease from now, plus `fields`."""
    lease_expires = _lease_until(timezone.now())
    renewed = Job.objects.filter(pk=job.pk, state="running").update(
        lease_expires=lease_expires, **fields
    )
    if renewed:
        job.lease_expires = lease_expires
    return bool(renewed)


def do_finish_job(job: Job, *, result: dict | None = None, error: str = "") -> Job:
    """Close a job: succeeded without `error`, failed with it."""
    state = "failed" if error else "succeeded"
    assert state in JOB_STATES
    with transaction.atomic():
        job.state = state
        job.finished = timezone.now()
        job.progress = 1.0 if state == "succeeded" else job.progress
        job.lease_expires = None
        job.result = relative_to_source(result or {}, job.release.source_uri)
        job.error = relative_to_source(error, job.release.source_uri)
        job.save(
            update_fields=[
                "state",
                "finished",
                "progress",
                "lease_expires",
                "result",
                "error",
            ]
        )
        do_record_event(
            "system:worker",
            f"job.{state}",
            job,
            after={"kind": job.kind, "duration_s": job.duration_s, "error": error},
            team=job.release.team,
        )
    return job


def do_record_gate_result(
    release: Release,
    *,
    gate: str,
    metric: str,
    observed: float | None,
    threshold: float | None,
    outcome: str,
    reason: str = "",
) -> GateResult:
    if outcome not in GATE_OUTCOMES:
        raise ValidationFailed(
            f"outcome must be one of {', '.join(GATE_OUTCOMES)}", field="outcome"
        )
    with transaction.atomic():
        result = GateResult.objects.create(
            release=release,
            gate=gate,
            metric=metric,
            observed=observed,
            threshold=threshold,
            outcome=outcome,
            reason=reason,
        )
        do_record_event(
            "system:worker",
            "gate.recorded",
            release,
            after=result.to_dict(),
            team=release.team,
        )
    return result


def do_record_manifest(
    release: Release,
    *,
    manifest_digest: str,
    files: list[FileDigest],
    signature: str = "",
    actor: Actor = "system:worker",
) -> Release:
    """Set the release's manifest digest (and signature) and replace its artifacts.
    Refused while an approval is in force (one made since the release was last
    reopened): approvals are bound to the digest."""
    with transaction.atomic():
        locked = Release.objects.select_for_update().get(pk=release.pk)
        approvals = locked.approvals.filter(decision="approve")
        reopened = _last_reopened(locked)
        if reopened is not None:
            approvals = approvals.filter(created__gt=reopened)
        if approvals.exists() and locked.manifest_digest != manifest_digest:
            raise Conflict(f"{locked} is approved for {locked.manifest_digest}")
        before = {"manifest_digest": locked.manifest_digest}
        locked.manifest_digest = manifest_digest
        locked.signature = signature
        locked.save(update_fields=["manifest_digest", "signature", "updated"])
        locked.artifacts.all().delete()
        Artifact.objects.bulk_create(
            Artifact(
                release=locked, path=f.path, size_bytes=f.size_bytes, digest=f.digest
            )
            for f in files
        )
        do_record_event(
            actor,
            "release.manifest_recorded",
            locked,
            before=before,
            after={"manifest_digest": manifest_digest, "files": len(files)},
            team=locked.model.team,
        )
    release.manifest_digest = manifest_digest
    release.signature = signature
    return release


# -- gate policy and gate evaluation ----------------------------------------------


def gate_policy_for(environment: Environment) -> GatePolicy:
    """The environment's gate policy; the default GatePolicy() when none is set."""
    row = EnvironmentGatePolicy.objects.filter(environment=environment).first()
    return row.spec if row is not None else GatePolicy()


def do_set_gate_policy(
    environment: Environment, policy: dict, *, actor: Actor
) -> EnvironmentGatePolicy:
    """Replace the environment's gate policy (admin role; a token needs the admin
    scope). ValidationFailed names the first bad field, e.g. policy.quality.x."""
    check_actor_in_team(actor, environment.team, scope="admin", roles=("admin",))
    try:
        spec = GatePolicy.model_validate(policy)
    except ValidationError as exc:
        raise validation_failed(exc, "policy") from exc
    with transaction.atomic():
        before = gate_policy_for(environment).model_dump(mode="json")
        row, _ = EnvironmentGatePolicy.objects.update_or_create(
            environment=environment, defaults={"policy": spec.model_dump(mode="json")}
        )
        do_record_event(
            actor,
            "environment.gate_policy_set",
            environment,
            before={"policy": before},
            after={"policy": row.policy},
            team=environment.team,
        )
    return row


def do_evaluate_release_gates(
    release: Release,
    *,
    quality: QualityReport | None,
    load: LoadTestReport | None,
    integrity_ok: bool | None,
    actor: Actor = "system:worker",
) -> GateDecision:
    """Hold the evidence against the gate policy of the release's target
    environment (gates.evaluate_policy) and record one GateResult per outcome,
    replacing the release's earlier results (the audit event keeps what they said).
    Returns the decision over them; moving the release is the caller's (the
    pipeline's gate stage). Missing evidence (None) is inconclusive, never a pass."""
    policy = gate_policy_for(release.target_environment)
    outcomes = evaluate_policy(policy, quality, load, integrity_ok)
    decision = evaluate_gates(outcomes)
    with transaction.atomic():
        release.gate_results.all().delete()
        GateResult.objects.bulk_create(
            GateResult(release=release, **outcome.to_dict()) for outcome in outcomes
        )
        counts = {o: sum(r.outcome == o for r in outcomes) for o in GATE_OUTCOMES}
        do_record_event(
            actor,
            "gate.evaluated",
            release,
            after={
                "outcome": decision.outcome,
                "reason": decision.reason,
                "counts": counts,
                "policy": policy.model_dump(mode="json"),
            },
            team=release.team,
        )
    return decision
