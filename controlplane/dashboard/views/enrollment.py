"""Agent enrollment from the fleet page, for the platform's operators (staff):
enroll a pending key (fingerprint shown beside it) under a name, pool, may-sign,
the external backends it may start (its own list, none, or only those named) and
the devices it may use (those it reported, all ticked by default); reject
it; revoke an enrolled agent. The same actions as the API's
(controlplane.api.agents), the same rule on who may."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_POST

from controlplane.dashboard.views.outcome import answer
from controlplane.fleet.enrollment import do_enroll_agent, do_reject_enrollment
from controlplane.fleet.models import Agent, EnrollmentRequest
from controlplane.releases.intake import revoke_agent as revoke


@require_POST
@login_required
def enroll_agent(request, enrollment_id: int):
    pending = get_object_or_404(EnrollmentRequest, pk=enrollment_id)
    fields = {
        "name": request.POST.get("name", "").strip() or None,
        "pool_queue": request.POST.get("pool_queue", "").strip() or None,
        "can_sign": request.POST.get("can_sign") == "on",
    }
    mode = request.POST.get("programs_mode", "own")
    if mode == "none":
        fields["allowed_programs"] = []
    elif mode == "list":  # one preset name or command template per line
        lines = request.POST.get("allowed_programs", "").splitlines()
        fields["allowed_programs"] = [line.strip() for line in lines if line.strip()]
    elif mode != "own":
        fields["allowed_programs"] = mode  # refused by name (not a list)
    if request.POST.get("devices_shown"):  # the form listed them: those ticked
        try:
            fields["devices"] = [int(i) for i in request.POST.getlist("devices")]
        except ValueError:
            fields["devices"] = request.POST.getlist("devices")  # refused by name
    return answer(
        request,
        lambda: do_enroll_agent(pending, actor=request.user, **fields),
        success=lambda agent: f"Enrolled {agent.name} (key {agent.fingerprint}).",
        then="dashboard:fleet",
    )


@require_POST
@login_required
def reject_enrollment(request, enrollment_id: int):
    pending = get_object_or_404(EnrollmentRequest, pk=enrollment_id)
    return answer(
        request,
        lambda: do_reject_enrollment(pending, actor=request.user),
        success=lambda rejected: f"Rejected the key {rejected.fingerprint}.",
        then="dashboard:fleet",
    )


@require_POST
@login_required
def revoke_agent(request, agent_id: int):
    agent = get_object_or_404(Agent, pk=agent_id)
    return answer(
        request,
        lambda: revoke(agent, actor=request.user),
        success=lambda revoked: (
            f"Revoked {revoked.name}: its messages are refused "
            "and its jobs sent elsewhere."
        ),
        then="dashboard:fleet",
    )
