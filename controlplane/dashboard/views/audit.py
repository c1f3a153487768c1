from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import render

from controlplane.dashboard import access
from controlplane.dashboard.forms import AuditFilterForm

EVENTS_PER_PAGE = 50


@login_required
def audit_log(request):
    form = AuditFilterForm(request.user, request.GET or None)
    events = access.audit_events(request.user)
    status = 200
    if form.is_bound:
        if form.is_valid():
            events = form.apply(events)
        else:
            events, status = events.none(), 400
    page = Paginator(events, EVENTS_PER_PAGE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    ctx = {"form": form, "page": page, "filter_query": query.urlencode()}
    return render(request, "dashboard/audit.html", ctx, status=status)
