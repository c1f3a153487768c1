"""What a signed-in user may see and do on the dashboard: the same team roles the API
checks (controlplane/accounts), through the same action checks. Everything a page
shows starts from one of these querysets; an object outside them is a 404, as in the
API, so an outsider learns nothing, not even that it exists."""

from django.db.models import QuerySet
from django.http import Http404

from controlplane.accounts.models import Team
from controlplane.audit.models import AuditEvent
from controlplane.errors import ControlPlaneError, IllegalTransition
from controlplane.fleet.models import Deployment, Environment
from controlplane.releases.actions.approvals import check_decide_release
from controlplane.releases.actions.promotion import check_reopen_release
from controlplane.releases.actions.remeasure import (
    check_remeasure_release,
    remeasurable_state,
)
from controlplane.releases.actions.rollbacks import check_rollback_environment
from controlplane.releases.models import ModelFamily, Release


def teams(user) -> QuerySet[Team]:
    return Team.objects.filter(memberships__user=user)


def releases(user) -> QuerySet[Release]:
    return Release.objects.visible_to(user).select_related(
        "model__team", "target_environment", "created_by"
    )


def model_families(user) -> QuerySet[ModelFamily]:
    return ModelFamily.objects.visible_to(user).select_related("team")


def environments(user) -> QuerySet[Environment]:
    return Environment.objects.filter(team__memberships__user=user).select_related(
        "team"
    )


def deployments(user) -> QuerySet[Deployment]:
    return Deployment.objects.filter(
        environment__team__memberships__user=user
    ).select_related("release__model", "environment", "agent")


def audit_events(user) -> QuerySet[AuditEvent]:
    # System-wide events (no team) are no team's to read, as in the API.
    return AuditEvent.objects.filter(team__memberships__user=user).select_related(
        "team"
    )


def release_or_404(user, release_id: int) -> Release:
    release = releases(user).filter(pk=release_id).first()
    if release is None:
        raise Http404("no such release")
    return release


def environment_or_404(user, environment_id: int) -> Environment:
    environment = environments(user).filter(pk=environment_id).first()
    if environment is None:
        raise Http404("no such environment")
    return environment


def decision_refusal(release: Release, user) -> str:
    """Why `user` may not approve `release` now, in words; "" when they may."""
    try:
        check_decide_release(release, user, decision="approve")
    except IllegalTransition:
        return f"it is {release.state}; a person decides on a release awaiting approval"
    except ControlPlaneError as exc:
        return exc.message
    return ""


def rollback_refusal(environment: Environment, user) -> str:
    """Why `user` may not roll `environment` back now; "" when they may."""
    try:
        check_rollback_environment(environment, user)
    except ControlPlaneError as exc:
        return exc.message
    return ""


def remeasure_refusal(release: Release, user) -> str | None:
    """Why `user` may not re-measure `release` now; "" when they may; None when its
    state admits no re-measure (the page offers none)."""
    if not remeasurable_state(release):
        return None
    try:
        check_remeasure_release(release, user)
    except ControlPlaneError as exc:
        return exc.message
    return ""


def reopen_refusal(release: Release, user) -> str:
    """Why `user` may not reopen `release` now; "" when they may."""
    try:
        check_reopen_release(release, user)
    except ControlPlaneError as exc:
        return exc.message
    return ""
