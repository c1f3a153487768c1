from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponseForbidden
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from controlplane.accounts.actions import membership_for
from controlplane.audit.models import AuditEvent
from controlplane.errors import ControlPlaneError, Forbidden, ValidationFailed
from controlplane.fleet.models import Environment
from controlplane.releases.actions import (
    check_approve_release,
    do_approve_release,
    do_reject_release,
    do_rollback_environment,
    previous_verified_deployment,
)
from controlplane.releases.models import Release


def _visible_release(request, release_id: int) -> Release:
    release = (
        Release.objects.visible_to(request.user)
        .select_related("model__team", "target_environment", "created_by")
        .filter(pk=release_id)
        .first()
    )
    if release is None:
        raise Http404("no such release")
    return release


def _environment_rows(user) -> list[dict]:
    rows = []
    environments = Environment.objects.filter(team__memberships__user=user)
    for environment in environments.select_related("team"):
        live = environment.live_deployment
        can_roll_back = (
            live is not None
            and live.state == "failed_verification"
            and membership_for(user, environment.team).can_approve
            and previous_verified_deployment(environment, live.release_id) is not None
        )
        rows.append(
            {"environment": environment, "live": live, "can_roll_back": can_roll_back}
        )
    return rows


@login_required
def release_list(request):
    releases = Release.objects.visible_to(request.user).select_related(
        "model__team", "target_environment"
    )
    state = request.GET.get("state", "")
    if state:
        releases = releases.filter(state=state)
    ctx = {
        "releases": releases[:200],
        "environments": _environment_rows(request.user),
        "state": state,
    }
    return render(request, "dashboard/release_list.html", ctx)


@login_required
def release_detail(request, release_id: int):
    release = _visible_release(request, release_id)
    membership = membership_for(request.user, release.team)
    ctx = {
        "release": release,
        "jobs": release.jobs.select_related("agent"),
        "gate_results": release.gate_results.all(),
        "approvals": release.approvals.select_related("user"),
        "deployments": release.deployments.select_related("environment", "agent"),
        "history": AuditEvent.objects.filter(
            object_type="release", object_id=str(release.pk)
        ).order_by("created", "id"),
        "can_decide": (
            membership.can_approve
            and release.state == "awaiting_approval"
            and release.created_by_id != request.user.pk
        ),
        "environments": [
            row
            for row in _environment_rows(request.user)
            if row["environment"].team_id == release.team_id
        ],
    }
    return render(request, "dashboard/release_detail.html", ctx)


@require_POST
@login_required
def approve_release(request, release_id: int):
    release = _visible_release(request, release_id)
    try:
        # Who may decide first (403), then what was sent. Like the API, an approval
        # names the digest the approver saw on the page, so a changed (or never
        # recorded) manifest is not approved unseen.
        check_approve_release(release, request.user)
        manifest_digest = request.POST.get("manifest_digest", "")
        if not manifest_digest:
            raise ValidationFailed(
                "approve needs the manifest digest you reviewed",
                field="manifest_digest",
            )
        do_approve_release(
            release,
            request.user,
            comment=request.POST.get("comment", ""),
            manifest_digest=manifest_digest,
        )
    except Forbidden as exc:
        return HttpResponseForbidden(exc.message)
    except ControlPlaneError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Approved {release}; deployment queued.")
    return redirect("dashboard:release-detail", release_id=release.pk)


@require_POST
@login_required
def reject_release(request, release_id: int):
    release = _visible_release(request, release_id)
    try:
        do_reject_release(
            release, request.user, comment=request.POST.get("comment", "")
        )
    except Forbidden as exc:
        return HttpResponseForbidden(exc.message)
    except ControlPlaneError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Rejected {release}.")
    return redirect("dashboard:release-detail", release_id=release.pk)


@require_POST
@login_required
def rollback_environment(request, environment_id: int):
    environment = (
        Environment.objects.filter(team__memberships__user=request.user)
        .filter(pk=environment_id)
        .first()
    )
    if environment is None:
        raise Http404("no such environment")
    try:
        deployment = do_rollback_environment(environment, request.user)
    except Forbidden as exc:
        return HttpResponseForbidden(exc.message)
    except ControlPlaneError as exc:
        messages.error(request, exc.message)
        return redirect("dashboard:release-list")
    messages.success(request, f"Rolling {environment} back to {deployment.release}.")
    return redirect("dashboard:release-detail", release_id=deployment.release_id)
