"""An environment's load-test plan on the dashboard: shown to every member as JSON,
edited by the team's admins in a textarea (the whole plan, as PUT takes it); a bad
plan is shown again with the error naming its field, nothing saved."""

import json

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpResponseForbidden
from django.shortcuts import redirect, render

from controlplane.accounts.actions import check_manage_team
from controlplane.dashboard import access
from controlplane.errors import ControlPlaneError, Forbidden, ValidationFailed
from controlplane.loadplans.actions import do_set_load_plan, load_plan_of


def _may_edit(user, environment) -> bool:
    try:
        check_manage_team(user, environment.team)
    except Forbidden:
        return False
    return True


@login_required
def load_plan(request, environment_id: int):
    environment = access.environment_or_404(request.user, environment_id)
    plan, is_default = load_plan_of(environment)
    text = json.dumps(plan.model_dump(mode="json"), indent=2, ensure_ascii=False)
    error, status = "", 200
    if request.method == "POST":
        text = request.POST.get("plan", "")
        try:
            do_set_load_plan(environment, _parsed(text), actor=request.user, prefix="")
        except Forbidden as exc:
            return HttpResponseForbidden(exc.message)
        except ControlPlaneError as exc:
            error, status = exc.message, 422
        else:
            messages.success(request, f"Saved the load plan of {environment}.")
            return redirect("dashboard:load-plan", environment_id=environment.pk)
    context = {
        "environment": environment,
        "text": text,
        "is_default": is_default,
        "error": error,
        "may_edit": _may_edit(request.user, environment),
    }
    return render(request, "dashboard/load_plan.html", context, status=status)


def _parsed(text: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValidationFailed(f"not JSON: {exc}", field="plan") from None
