"""The agents. They are shared infrastructure (no team owns one), so any member of a
team sees the list: name, GPU, memory, heartbeat, health. The jobs and deployments
shown on each are only those of the viewer's teams; someone in no team sees no
agents at all."""

from django.contrib.auth.decorators import login_required
from django.db.models import Prefetch, Q
from django.shortcuts import render
from django.utils import timezone

from controlplane.dashboard import access
from controlplane.dashboard.agent_facts import agent_facts
from controlplane.dashboard.health import agent_dead_after_s, agent_health, job_health
from controlplane.fleet.models import Agent, Deployment, EnrollmentRequest
from controlplane.releases.models import Job


def _on_agents_now(deployments):
    """Those an agent holds now: being deployed, or what their environment serves
    (Deployment.objects.serving(): live or failed verification, not ended). A
    superseded or replaced deployment has ended and is no longer on its agent."""
    serving = Deployment.objects.serving().values("pk")
    return deployments.filter(
        Q(pk__in=serving) | Q(state="deploying", ended__isnull=True)
    )


def _rows(user) -> list[dict]:
    if not access.teams(user).exists():
        return []
    now = timezone.now()
    jobs = Job.objects.filter(
        state="running", release__in=access.releases(user)
    ).select_related("release__model", "agent")
    deployments = _on_agents_now(access.deployments(user))
    agents = Agent.objects.prefetch_related(
        Prefetch("jobs", queryset=jobs, to_attr="visible_jobs"),
        Prefetch("deployments", queryset=deployments, to_attr="visible_deployments"),
    )
    return [
        {
            "agent": agent,
            "health": agent_health(agent, now),
            "facts": agent_facts(agent),
            "jobs": [(job, job_health(job, now)) for job in agent.visible_jobs],
            "deployments": agent.visible_deployments,
        }
        for agent in agents
    ]


@login_required
def fleet(request):
    operator = request.user.is_staff or request.user.is_superuser
    ctx = {
        "rows": _rows(request.user),
        "dead_after_s": agent_dead_after_s(),
        # Keys waiting for an operator (staff only: fleet enrollment is theirs).
        "operator": operator,
        "pending": (
            EnrollmentRequest.objects.filter(state="pending") if operator else []
        ),
    }
    return render(request, "dashboard/fleet.html", ctx)
