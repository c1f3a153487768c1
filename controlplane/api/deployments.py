from django.http import HttpRequest
from ninja import Query, Router

from controlplane.api.auth import read_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    DeploymentFilters,
    DeploymentOut,
    Page,
)
from controlplane.api.scoping import deployments, page, principal_of

router = Router(tags=["deployments"])


@router.get(
    "/deployments",
    auth=read_auth(),
    response={200: Page[DeploymentOut], **READ_ERRORS},
    summary="List deployments, newest first (filters: environment, release, state)",
)
def list_deployments(request: HttpRequest, filters: Query[DeploymentFilters]) -> dict:
    queryset = deployments(principal_of(request))
    if filters.environment is not None:
        queryset = queryset.filter(environment__name=filters.environment)
    if filters.release is not None:
        queryset = queryset.filter(release_id=filters.release)
    if filters.state is not None:
        queryset = queryset.filter(state=filters.state)
    return page(queryset, filters)
