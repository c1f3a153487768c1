"""A deployment's life: started, live, failed."""

from django.db import transaction
from django.utils import timezone

from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import Conflict
from controlplane.fleet.models import Agent, Deployment, Environment
from controlplane.releases.actions.transitions import (
    do_transition_release,
    legal_targets,
)
from controlplane.releases.models import Release


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
    deployment: Deployment,
    *,
    actor: Actor,
    reason: str,
    verification: bool = False,
    ended: bool = False,
) -> Deployment:
    """Mark a deploying or live deployment failed (or failed_verification when the
    bytes did not match) and move its release along. A failed one ends; one that
    failed verification ends only with `ended` (a deploy that never served),
    else it is what the environment serves until an operator rolls back."""
    new_state = "failed_verification" if verification else "failed"
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        before = deployment.state
        if before not in ("deploying", "live"):
            raise Conflict(f"deployment {deployment.pk} is {before}")
        deployment.state = new_state
        deployment.reason = reason
        if new_state == "failed" or ended:
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


def do_refuse_deployment(
    deployment: Deployment,
    *,
    actor: Actor,
    reason: str,
    agent: Agent | None = None,
    serving_id: str = "",
) -> Deployment:
    """deploying -> failed although its agent started the server: the control
    plane refuses what it would have made live (its digest became untrusted
    meanwhile). Keeps the server's agent and id, so an undeploy job can stop it;
    the release fails with `reason`."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        deployment.agent = agent or deployment.agent
        deployment.serving_id = serving_id or deployment.serving_id
        deployment.save(update_fields=["agent", "serving_id"])
        return do_fail_deployment(deployment, actor=actor, reason=reason)


def do_record_stray_server(
    deployment: Deployment, *, agent: Agent | None, serving_id: str
) -> Deployment:
    """A deploy answered, with the server it started, after `deployment` stopped
    deploying (failed meanwhile): keep which server that is, so an undeploy job
    can stop it. The deployment's state is not changed."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        deployment.agent = agent or deployment.agent
        deployment.serving_id = serving_id
        deployment.save(update_fields=["agent", "serving_id"])
    return deployment


def do_quarantine_release(release: Release, *, actor: Actor, reason: str) -> bool:
    """Quarantine `release` (its digest untrusted; never a rollback target) from
    whatever state it is in now where the state machine allows it (superseded,
    rolled back, failed verification); True when it is quarantined. Otherwise
    (e.g. deploying again: that deploy's verify-on-load re-hashes the copy) False,
    with `reason` kept in a release.quarantine_refused event."""
    with transaction.atomic():
        locked = Release.objects.select_for_update().get(pk=release.pk)
        if locked.state == "quarantined":
            return True
        if "quarantined" in legal_targets(locked.state):
            do_transition_release(locked, "quarantined", actor=actor, reason=reason)
            return True
        do_record_event(
            actor,
            "release.quarantine_refused",
            locked,
            after={"state": locked.state, "reason": reason},
            team=locked.team,
        )
    return False


def do_place_deployment(
    deployment: Deployment,
    *,
    actor: Actor,
    agent: Agent | None,
    placement: dict | None,
    need_bytes: int,
    note: str,
    stopped: list[int] = (),
) -> Deployment:
    """Record where `deployment` runs (controlplane.releases.placing): its agent,
    its placement as the deploy job carries it (None: not placed), the release's
    need per device, why; the deployments whose servers its deploy stops first
    become cold (`unloaded`), kept verified on disk for a rollback."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if deployment.state != "deploying":
            raise Conflict(f"deployment {deployment.pk} is {deployment.state}")
        deployment.agent = agent
        deployment.placement = placement
        deployment.memory_need_bytes = need_bytes
        deployment.placement_note = note
        deployment.save(
            update_fields=["agent", "placement", "memory_need_bytes", "placement_note"]
        )
        do_mark_unloaded(Deployment.objects.filter(pk__in=stopped), actor=actor)
        do_record_event(
            actor,
            "deployment.placed",
            deployment,
            after={
                "agent": agent.name if agent else None,
                **deployment.placement_dict(),
            },
            team=deployment.environment.team,
        )
    return deployment


def do_mark_unloaded(deployments, *, actor: Actor) -> list[Deployment]:
    """Their servers are being stopped (an undeploy job, or a deploy that stops
    them first): a rollback to one of them restarts it cold."""
    marked = []
    with transaction.atomic():
        for deployment in deployments.select_for_update().filter(unloaded=None):
            deployment.unloaded = timezone.now()
            deployment.save(update_fields=["unloaded"])
            do_record_event(
                actor,
                "deployment.unloaded",
                deployment,
                after={"serving_id": deployment.serving_id, "warm": False},
                team=deployment.environment.team,
            )
            marked.append(deployment)
    return marked
