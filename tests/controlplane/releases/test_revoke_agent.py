"""Revoking an agent (controlplane.releases.intake.revoke_agent) sends every job
it holds elsewhere at once, in the same transaction: the ones it runs, the ones
its last heartbeat listed, and the ones waiting on its own queue, each with a new
attempt whose old result no longer counts. A re-verification of a copy only it
serves fails with the reason; nothing is revoked when a job cannot be sent."""

import pytest
from django.utils import timezone

from controlplane.fleet.actions import do_set_serving_backend, do_set_serving_preset
from controlplane.fleet.models import Agent, Deployment
from controlplane.fleet.tasks import record_heartbeat
from controlplane.releases import pipeline
from controlplane.releases.intake import revoke_agent
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import (
    record_job_result,
    run_deployment,
    run_reverification,
)
from gpuagent.protocol import DeployResult, JobResult
from tests.controlplane.releases.test_serving_backend import ENGINE_TEMPLATE


@pytest.fixture
def external(environment, owner, operator, local_agent):
    do_set_serving_preset("own-engine", ENGINE_TEMPLATE, actor=operator)
    do_set_serving_backend(
        environment, {"kind": "external", "preset": "own-engine"}, actor=owner
    )
    # "local" is enrolled for the preset (preferred), "checker" leaves it to itself
    Agent.objects.filter(name="local").update(allowed_programs=["own-engine"])
    return environment


def sent(local_agent, kind: str) -> list[tuple[str, int, int]]:
    return [(m.queue, r.job_id, r.attempt) for m, r in local_agent.pending(kind)]


def answer(local_agent, me, request, payload) -> str:
    """`me`'s sealed answer to the job `request` asked for (its attempt)."""
    result = JobResult(
        job_id=request.job_id,
        kind=request.kind,
        ok=True,
        agent=me.name,
        started=timezone.now(),
        finished=timezone.now(),
        payload=payload.model_dump(mode="json"),
    )
    return record_job_result(*local_agent.tasks.sealed_result(result, request, me))


def test_it_resends_a_job_waiting_on_the_agents_own_queue(
    external, make_release, local_agent
):
    release = make_release(state="approved")
    run_deployment(release.pk)
    ((queue, job_id, attempt),) = sent(local_agent, "deploy")
    assert (queue, attempt) == ("agent.local", 1)  # waiting there, not taken

    revoke_agent(local_agent.row, actor="system:tests")

    job = Job.objects.get(pk=job_id)
    assert (job.state, job.attempts, job.agent) == ("queued", 2, None)
    assert job.error == "agent local was revoked"
    assert sent(local_agent, "deploy")[1:] == [("agent.checker", job_id, 2)]
    (_, old), (_, new) = local_agent.pending("deploy")
    served = DeployResult(ok=True, endpoint="http://a:8100", deployment_id="srv-1")
    # the old attempt's answer counts neither from the revoked agent nor another
    assert answer(local_agent, local_agent.agent, old, served) == "refused"
    assert answer(local_agent, local_agent.checker, old, served) == "ignored"
    assert Release.objects.get(pk=release.pk).state == "deploying"
    assert answer(local_agent, local_agent.checker, new, served) == "succeeded"
    assert Release.objects.get(pk=release.pk).state == "live"


def test_it_resends_a_job_its_last_heartbeat_listed(make_release, local_agent):
    release = make_release(state="approved")
    run_deployment(release.pk)
    ((queue, job_id, _),) = sent(local_agent, "deploy")
    assert queue == "agents"  # the pool: the agent's beat says it took it
    beat = local_agent.beat(local_agent.agent.incarnation, running_jobs=[job_id])
    assert record_heartbeat(*beat) == "online"

    revoke_agent(local_agent.row, actor="system:tests")

    job = Job.objects.get(pk=job_id)
    assert (job.state, job.attempts) == ("queued", 2)
    assert sent(local_agent, "deploy")[1:] == [("agents", job_id, 2)]


def test_a_revocation_resends_whatever_attempts_the_job_had(
    external, make_release, local_agent, settings
):
    settings.RELEASEGATE_JOB_MAX_ATTEMPTS = 1
    release = make_release(state="approved")
    run_deployment(release.pk)

    revoke_agent(local_agent.row, actor="system:tests")

    job = Job.objects.get(release=release, kind="deploy")
    assert (job.state, job.attempts) == ("queued", 2)


def test_a_reverification_only_the_revoked_agent_can_run_fails_with_the_reason(
    make_release, local_agent
):
    release = make_release(state="approved")
    run_deployment(release.pk)
    local_agent.answer("deploy", DeployResult(ok=True, endpoint="http://a:1"))
    deployment = Deployment.objects.get(release=release)
    run_reverification(deployment.pk)
    job = Job.objects.get(release=release, kind="reverify")

    revoke_agent(local_agent.row, actor="system:tests")

    job.refresh_from_db()
    assert (job.state, job.attempts) == ("failed", 1)
    assert job.error == "agent local was revoked; only it serves this copy"
    deployment.refresh_from_db()
    assert deployment.state == "live"  # nothing was learnt of the copy
    assert run_reverification(deployment.pk) == "agent-revoked"
    assert Job.objects.filter(kind="reverify").count() == 1


def test_nothing_is_revoked_when_a_job_cannot_be_sent(
    external, make_release, local_agent, monkeypatch
):
    first, second = make_release(state="approved"), make_release(state="approved")
    run_deployment(first.pk)
    run_deployment(second.pk)
    resend = pipeline._send
    calls = []

    def send_once(job, exclude=None):
        calls.append(job.pk)
        if len(calls) > 1:
            raise ConnectionError("the outbox's database went away")
        resend(job, exclude)

    monkeypatch.setattr(pipeline, "_send", send_once)

    with pytest.raises(ConnectionError):
        revoke_agent(local_agent.row, actor="system:tests")

    assert Agent.objects.get(name="local").enrollment == "enrolled"
    attempts = Job.objects.filter(kind="deploy").values_list("attempts", flat=True)
    assert list(attempts) == [1, 1]
    assert len(sent(local_agent, "deploy")) == 2
