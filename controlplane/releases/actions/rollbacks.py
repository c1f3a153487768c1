"""Rolling an environment back to its previous verified release."""

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.accounts.actions import check_actor_in_team
from controlplane.accounts.models import APPROVER_ROLES
from controlplane.audit.actions import Actor, do_record_event
from controlplane.dispatch.actions import do_enqueue_task
from controlplane.errors import Conflict
from controlplane.fleet.models import Deployment, Environment
from controlplane.releases.actions.deployments import do_start_deployment
from controlplane.releases.actions.promotion import RUN_DEPLOYMENT
from controlplane.releases.actions.transitions import do_transition_release


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


def check_rollback_environment(
    environment: Environment,
    actor: Actor,
    *,
    expected_target_release_id: int | None = None,
) -> Deployment:
    """Raise as do_rollback_environment would now: not allowed (Forbidden: the
    promote scope and an approver role), nothing live, no previous verified
    release, or another target than `expected_target_release_id`, the one the
    caller showed (Conflict). Returns the target deployment."""
    check_actor_in_team(actor, environment.team, scope="promote", roles=APPROVER_ROLES)
    return _rollback_plan(environment, expected_target_release_id)[1]


def do_rollback_environment(
    environment: Environment,
    actor: Actor,
    *,
    reason: str = "",
    expected_target_release_id: int | None = None,
) -> Deployment:
    """Replace what is live (or failed verification) in `environment` with its
    previous verified release. The current release becomes rolled_back, or
    quarantined when it failed verification. Returns the new deploying Deployment;
    the deployment task finishes it on commit (and, should its copy no longer
    verify, do_continue_rollback tries the next older candidate). With
    `expected_target_release_id` (what the caller was shown), a target that changed
    in the meantime is refused (Conflict), checked under the deployment's lock."""
    check_actor_in_team(actor, environment.team, scope="promote", roles=APPROVER_ROLES)
    return _roll_back(
        environment,
        actor,
        reason=reason,
        expected_target_release_id=expected_target_release_id,
    )


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


def _rollback_plan(
    environment: Environment,
    expected_target_release_id: int | None = None,
    *,
    lock: bool = False,
) -> tuple[Deployment, Deployment]:
    """(what is served now, the deployment to go back to), or Conflict."""
    serving = Deployment.objects.serving().filter(environment=environment)
    if lock:
        serving = serving.select_for_update()
    current = serving.order_by("-started", "-id").first()
    if current is None:
        raise Conflict(f"nothing is live in {environment} to roll back")
    target = previous_verified_deployment(environment, current.release_id)
    if target is None:
        raise Conflict(
            f"{environment} has no previous verified release to roll back to"
        )
    expected = expected_target_release_id
    if expected is not None and target.release_id != expected:
        raise Conflict(
            f"the rollback target of {environment} changed since it was shown "
            f"(now {target.release}, not release {expected}); review it again",
            field="target_release_id",
        )
    return current, target


def _roll_back(
    environment: Environment,
    actor: Actor,
    *,
    reason: str,
    expected_target_release_id: int | None = None,
) -> Deployment:
    with transaction.atomic():
        current, target = _rollback_plan(
            environment, expected_target_release_id, lock=True
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
