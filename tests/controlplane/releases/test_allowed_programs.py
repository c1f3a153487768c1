"""The control plane holds deploys of an external backend to the programs an
operator enrolled each agent for (controlplane.fleet.programs): such a deploy
goes only to an agent whose record allows the command's whole argument shape,
fails at once with the reason when none may run it, and a deploy result from an
agent whose record does not allow it is refused (audited) and sent to one that
may. A record of null leaves the choice to the agent's own list."""

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.actions import do_set_serving_backend, do_set_serving_preset
from controlplane.fleet.models import Agent, Deployment
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import run_deployment
from gpuagent.protocol import AGENT_PRESET_TEMPLATES, DeployResult, JobResult
from tests.controlplane.releases.test_serving_backend import ENGINE_TEMPLATE


@pytest.fixture
def external(environment, owner, operator):
    """`environment` serves through the operator's preset "own-engine"."""
    do_set_serving_preset("own-engine", ENGINE_TEMPLATE, actor=operator)
    do_set_serving_backend(
        environment, {"kind": "external", "preset": "own-engine"}, actor=owner
    )
    return environment


def enrolled_for(**records) -> None:
    """Test setup: the agents' enrolled allowed programs, by agent name."""
    for name, programs in records.items():
        Agent.objects.filter(name=name).update(allowed_programs=programs)


def deploy_messages(local_agent) -> list[tuple[str, int]]:
    return [(m.queue, r.attempt) for m, r in local_agent.pending("deploy")]


def refusals() -> list[str]:
    return list(
        AuditEvent.objects.filter(verb="agent.message_refused")
        .order_by("id")
        .values_list("after__reason", flat=True)
    )


@pytest.mark.parametrize("entry", ["own-engine", ENGINE_TEMPLATE])
def test_it_sends_an_external_deploy_only_to_an_agent_enrolled_for_its_command(
    external, make_release, local_agent, entry
):
    # "checker" sorts first and leaves the choice to itself; "local" is enrolled
    # for the preset (by its name, or its template word for word): the control
    # plane prefers the agent whose record it checked.
    enrolled_for(local=[entry], checker=None)
    release = make_release(state="approved")

    assert run_deployment(release.pk) == "deploying"

    assert deploy_messages(local_agent) == [("agent.local", 1)]


def test_it_fails_the_deploy_with_the_reason_when_no_agent_may_start_it(
    external, make_release, local_agent
):
    enrolled_for(local=["vllm"], checker=[])
    release = make_release(state="approved")

    assert run_deployment(release.pk) == "failed"

    job = Job.objects.get(release=release, kind="deploy")
    assert job.state == "failed"
    assert job.error.startswith(
        "no live enrolled agent may start this environment's serving backend: "
    )
    assert "is not an argument shape agent checker is enrolled to start" in job.error
    assert "(allowed: vllm)" in job.error
    deployment = Deployment.objects.get(release=release)
    assert (deployment.state, deployment.reason) == ("failed", job.error)
    assert Release.objects.get(pk=release.pk).failure_reason == job.error
    assert deploy_messages(local_agent) == []


def test_a_record_of_null_leaves_the_choice_to_the_agent(
    external, make_release, local_agent
):
    enrolled_for(local=None, checker=[])
    release = make_release(state="approved")

    run_deployment(release.pk)

    assert deploy_messages(local_agent) == [("agent.local", 1)]


def test_an_agents_own_preset_is_checked_by_its_template(
    environment, owner, make_release, local_agent
):
    do_set_serving_backend(
        environment, {"kind": "external", "preset": "vllm"}, actor=owner
    )
    enrolled_for(local=[ENGINE_TEMPLATE], checker=[AGENT_PRESET_TEMPLATES["vllm"]])
    release = make_release(state="approved")

    run_deployment(release.pk)

    assert deploy_messages(local_agent) == [("agent.checker", 1)]


def test_the_engine_backend_goes_to_the_pool_whatever_the_records(
    make_release, local_agent
):
    enrolled_for(local=[], checker=[])
    release = make_release(state="approved")

    run_deployment(release.pk)

    assert deploy_messages(local_agent) == [("agents", 1)]


def test_it_refuses_a_deploy_result_from_an_agent_not_enrolled_for_its_command(
    external, make_release, local_agent
):
    enrolled_for(local=["vllm"], checker=["own-engine"])
    release = make_release(state="approved")
    run_deployment(release.pk)
    served = DeployResult(ok=True, endpoint="http://a:8100", deployment_id="srv-1")

    # "local" takes the job off the broker and answers: its record allows vllm only
    outcome = local_agent.answer("deploy", served)

    assert outcome == "refused"
    (reason,) = refusals()
    assert "is not an argument shape agent local is enrolled to start" in reason
    job = Job.objects.get(release=release, kind="deploy")
    assert (job.state, job.attempts) == ("queued", 2)
    assert Deployment.objects.get(release=release).state == "deploying"
    assert Release.objects.get(pk=release.pk).state == "deploying"
    # sent again, to the agent that may start it, whose answer counts
    assert deploy_messages(local_agent) == [("agent.checker", 2)]
    (message, request), *_ = local_agent.pending("deploy")
    result = JobResult(
        job_id=request.job_id,
        kind="deploy",
        ok=True,
        agent="checker",
        started=timezone.now(),
        finished=timezone.now(),
        payload=served.model_dump(mode="json"),
    )
    outcome = local_agent.record(message, request, result, local_agent.checker)

    assert outcome == "succeeded"
    assert Release.objects.get(pk=release.pk).state == "live"
    assert Deployment.objects.get(release=release).agent.name == "checker"
