"""What is live where, and rollback: the environments page shows, before anyone
presses anything, which release a rollback would bring back and whether its bytes
still verified when last checked; the button leads to a confirmation naming both
releases, and the confirmed post must name the same target the page showed."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.dashboard import access
from controlplane.dashboard.health import agent_health
from controlplane.dashboard.views.outcome import answer, confirmed
from controlplane.errors import ValidationFailed
from controlplane.releases import evidence
from controlplane.releases.actions.rollbacks import (
    check_rollback_environment,
    do_rollback_environment,
    previous_verified_deployment,
)
from controlplane.releases.timings import rollback_readiness

RECENT_DEPLOYMENTS = 5


def _rollback_target(environment, live):
    if live is None:
        return None
    return previous_verified_deployment(environment, live.release_id)


def environment_row(environment, user, now) -> dict:
    live = environment.live_deployment
    target = _rollback_target(environment, live)
    return {
        "environment": environment,
        "live": live,
        "live_agent_health": agent_health(live.agent, now)
        if live and live.agent
        else None,
        "target": target,
        "target_verification": evidence.verification(target.release)
        if target
        else None,
        "target_readiness": rollback_readiness(target) if target else None,
        "rollback_refusal": access.rollback_refusal(environment, user),
        "recent": environment.deployments.select_related("release__model", "agent")[
            :RECENT_DEPLOYMENTS
        ],
    }


def _rows(user) -> list[dict]:
    now = timezone.now()
    return [environment_row(e, user, now) for e in access.environments(user)]


@login_required
def environment_list(request):
    return render(request, "dashboard/environments.html", {"rows": _rows(request.user)})


@login_required
def environment_rows(request):
    return render(
        request, "dashboard/_environments.html", {"rows": _rows(request.user)}
    )


@require_POST
@login_required
def rollback_environment(request, environment_id: int):
    environment = access.environment_or_404(request.user, environment_id)

    def attempt():
        if not confirmed(request):
            check_rollback_environment(environment, request.user)
            row = environment_row(environment, request.user, timezone.now())
            return render(request, "dashboard/confirm_rollback.html", row)
        # Like an approval's digest: the confirmed post names the target the page
        # showed, and the action refuses another one (another rollback, a
        # quarantine in between) under its lock, so none is rolled back to unseen.
        target = _posted_target(request)
        if target is None:
            check_rollback_environment(environment, request.user)  # who may: first
            raise ValidationFailed(
                "a rollback names the target release the page showed",
                field="target_release_id",
            )
        return do_rollback_environment(
            environment, request.user, expected_target_release_id=target
        )

    return answer(
        request,
        attempt,
        success=lambda deployment: (
            f"Rolling {environment} back to {deployment.release}."
        ),
        then="dashboard:environment-list",
    )


def _posted_target(request) -> int | None:
    posted = request.POST.get("target_release_id", "")
    return int(posted) if posted.isascii() and posted.isdigit() else None
