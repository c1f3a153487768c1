from django.http import HttpRequest
from ninja import Query, Router

from controlplane.api.auth import read_auth
from controlplane.api.schemas import READ_ERRORS, AuditEventOut, AuditFilters, Page
from controlplane.api.scoping import audit_events, page, principal_of

router = Router(tags=["audit"])


@router.get(
    "/audit-events",
    auth=read_auth(),
    response={200: Page[AuditEventOut], **READ_ERRORS},
    summary="Read the team's audit log, newest first",
)
def list_audit_events(request: HttpRequest, filters: Query[AuditFilters]) -> dict:
    queryset = audit_events(principal_of(request))
    if filters.verb is not None:
        queryset = queryset.filter(verb=filters.verb)
    if filters.object_type is not None:
        queryset = queryset.filter(object_type=filters.object_type)
    if filters.object_id is not None:
        queryset = queryset.filter(object_id=filters.object_id)
    if filters.actor is not None:
        queryset = queryset.filter(actor_name__icontains=filters.actor)
    if filters.since is not None:
        queryset = queryset.filter(created__gte=filters.since)
    if filters.until is not None:
        queryset = queryset.filter(created__lt=filters.until)
    return page(queryset, filters)
