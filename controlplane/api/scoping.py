"""Team scoping: every query the API runs starts from one of these, so a caller only
ever sees the objects of its own team(s); anything else is a 404, the same answer as
for an id that does not exist (an outsider learns nothing, not even existence)."""

from collections.abc import Callable
from typing import Any

from django.db.models import Prefetch, QuerySet
from django.http import HttpRequest
from django.shortcuts import get_object_or_404

from controlplane.accounts.models import ApiToken, Membership, Team
from controlplane.api.auth import Principal
from controlplane.api.schemas import PageParams
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Deployment, Environment
from controlplane.releases.models import Approval, ModelFamily, Release


def principal_of(request: HttpRequest) -> Principal:
    return request.auth  # type: ignore[attr-defined]  # set by the auth callables


def model_families(principal: Principal) -> QuerySet[ModelFamily]:
    return ModelFamily.objects.filter(team_id__in=principal.team_ids).select_related(
        "team"
    )


def releases(principal: Principal) -> QuerySet[Release]:
    return Release.objects.filter(model__team_id__in=principal.team_ids).select_related(
        "model__team", "target_environment", "created_by"
    )


# What Release.to_dict(detail=True) reads: one query per relation, not one per row
# (its jobs are read by to_dict itself: the pipeline's, without the re-verifications).
RELEASE_DETAIL_PREFETCHES = (
    "artifacts",
    "gate_results",
    Prefetch("approvals", queryset=Approval.objects.select_related("user", "token")),
    Prefetch(
        "deployments",
        queryset=Deployment.objects.select_related(
            "release__model", "environment", "agent"
        ),
    ),
)


def get_release(
    principal: Principal, release_id: int, *, detail: bool = False
) -> Release:
    queryset = releases(principal)
    if detail:
        queryset = queryset.prefetch_related(*RELEASE_DETAIL_PREFETCHES)
    return get_object_or_404(queryset, pk=release_id)


def environments(principal: Principal) -> QuerySet[Environment]:
    return Environment.objects.filter(team_id__in=principal.team_ids).select_related(
        "team"
    )


def get_environment(principal: Principal, environment_id: int) -> Environment:
    return get_object_or_404(environments(principal), pk=environment_id)


def deployments(principal: Principal) -> QuerySet[Deployment]:
    return Deployment.objects.filter(
        environment__team_id__in=principal.team_ids
    ).select_related("release__model", "environment", "agent")


def teams(principal: Principal) -> QuerySet[Team]:
    return Team.objects.filter(id__in=principal.team_ids)


def get_team(principal: Principal, slug: str) -> Team:
    return get_object_or_404(teams(principal), slug=slug)


def memberships(principal: Principal) -> QuerySet[Membership]:
    return Membership.objects.filter(team_id__in=principal.team_ids).select_related(
        "team", "user"
    )


def api_tokens(principal: Principal) -> QuerySet[ApiToken]:
    # Its own tokens, or all of the team's for an admin; never a secret.
    return ApiToken.objects.visible_to(
        principal.user, principal.team_ids
    ).select_related("team", "user")


def audit_events(principal: Principal) -> QuerySet[AuditEvent]:
    # Events without a team (system-wide) are not any team's to read.
    return AuditEvent.objects.filter(team_id__in=principal.team_ids).select_related(
        "team"
    )


def page(
    queryset: QuerySet,
    params: PageParams,
    row: Callable[[Any], dict] = lambda obj: obj.to_dict(),
) -> dict[str, Any]:
    """One page of `queryset` as `row(obj)` dicts (to_dict() unless told), in the
    model's default ordering."""
    window = queryset[params.offset : params.offset + params.limit]
    return {
        "items": [row(obj) for obj in window],
        "count": queryset.count(),
        "limit": params.limit,
        "offset": params.offset,
    }
