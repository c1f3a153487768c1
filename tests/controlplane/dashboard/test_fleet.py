from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.fleet.actions import do_register_agent
from controlplane.fleet.models import Agent
from controlplane.releases.actions.deployments import do_start_deployment
from controlplane.releases.actions.jobs import do_start_job


def _rows(response) -> dict:
    return {row["agent"].name: row for row in response.context["rows"]}


def test_it_lists_agents_with_gpu_memory_and_heartbeat(client, owner, agent):
    client.force_login(owner)

    response = client.get("/fleet/")

    row = _rows(response)["gpu-a1"]
    assert row["health"].alive is True
    body = response.content.decode()
    assert "NVIDIA H100 80GB HBM3" in body
    assert "80.0 GiB" in body
    assert f"{agent.last_heartbeat:%Y-%m-%d %H:%M:%S}" in body


def test_it_marks_an_agent_that_missed_its_heartbeats_dead(client, owner, agent):
    Agent.objects.filter(pk=agent.pk).update(
        last_heartbeat=timezone.now() - timedelta(minutes=10)
    )
    client.force_login(owner)

    response = client.get("/fleet/")

    health = _rows(response)["gpu-a1"]["health"]
    assert (health.alive, health.label) == (False, "dead")
    assert b'<tr data-agent="gpu-a1" class="dead">' in response.content
    assert b"missed heartbeats: last seen 10 min ago" in response.content


@pytest.fixture
def busy(agent, make_live, make_release):
    """(live, running): the agent serves one release and evaluates another."""
    live = make_live("0.9.0")
    running = make_release("1.1.0", state="evaluating")
    do_start_job(running, "evaluate", agent=agent)
    return live, running


def test_it_shows_current_jobs_and_deployments(client, owner, busy):
    live, running = busy
    client.force_login(owner)

    response = client.get("/fleet/")

    row = _rows(response)["gpu-a1"]
    assert [job.release for job, _ in row["jobs"]] == [running]
    assert [d.release for d in row["deployments"]] == [live]


def test_it_shows_only_the_deployments_an_agent_serves_now(
    client, owner, agent, make_live, make_release
):
    make_live("0.9.0")  # superseded by 0.9.5: ended, no longer on the agent
    current = make_live("0.9.5")
    approved = make_release("1.0.0", state="approved")
    deploying = do_start_deployment(approved, actor="system:worker", agent=agent)
    client.force_login(owner)

    response = client.get("/fleet/")

    deployments = _rows(response)["gpu-a1"]["deployments"]
    assert sorted(d.pk for d in deployments) == sorted(
        [current.deployments.get().pk, deploying.pk]
    )


def test_it_shows_outsiders_none_of_the_teams_jobs_or_deployments(
    client, outsider, busy
):
    live, running = busy
    client.force_login(outsider)

    response = client.get("/fleet/")

    row = _rows(response)["gpu-a1"]
    assert row["jobs"] == [] and row["deployments"] == []
    assert str(live).encode() not in response.content
    assert str(running).encode() not in response.content


def test_it_shows_no_agents_to_someone_in_no_team(client, django_user_model, agent):
    loner = django_user_model.objects.create_user("nobody", password="x" * 12)
    do_register_agent("gpu-z9", queue="agent.gpu-z9")
    client.force_login(loner)

    response = client.get("/fleet/")

    assert response.context["rows"] == []
    assert b"gpu-a1" not in response.content


@pytest.mark.parametrize(("dead_after_s", "dead"), [(30, True), (120, False)])
def test_it_judges_death_by_the_configured_silence(
    client, owner, agent, settings, dead_after_s, dead
):
    settings.AGENT_DEAD_AFTER_S = dead_after_s
    Agent.objects.filter(pk=agent.pk).update(
        last_heartbeat=timezone.now() - timedelta(seconds=60)
    )
    client.force_login(owner)

    response = client.get("/fleet/")

    assert _rows(response)["gpu-a1"]["health"].alive is not dead
    assert (b'class="dead"' in response.content) is dead
    assert f"dead after {dead_after_s} s without a heartbeat".encode() in (
        response.content
    )


def test_it_marks_an_agent_that_never_sent_a_heartbeat_dead(client, owner, agent):
    Agent.objects.filter(pk=agent.pk).update(last_heartbeat=None)
    client.force_login(owner)

    body = client.get("/fleet/").content.decode()

    assert '<tr data-agent="gpu-a1" class="dead">' in body
    assert "never sent a heartbeat" in body


def test_it_shows_what_the_agent_reports_about_itself(client, owner, db):
    do_register_agent(
        "gpu-b2",
        queue="agent.gpu-b2",
        capabilities={"kv_cache_dtypes": ["int8", "fp8"], "engine": "releasegate"},
    )
    client.force_login(owner)

    body = client.get("/fleet/").content.decode()

    assert "kv cache dtypes:</span> int8, fp8" in body
    assert "engine:</span> releasegate" in body


def test_it_shows_heartbeat_fields_the_page_does_not_know_yet(
    client, owner, agent, monkeypatch
):
    # What a later heartbeat adds to Agent.to_dict() shows without a template change.
    reported = Agent.to_dict

    def to_dict(self):
        return {
            **reported(self),
            "gpu_memory_used_bytes": 3 * 2**30,
            "engine_healthy": False,
            "current_jobs": [17, 18],
            "gpu_utilization": None,
        }

    monkeypatch.setattr(Agent, "to_dict", to_dict)
    client.force_login(owner)

    body = client.get("/fleet/").content.decode()

    assert "gpu memory used:</span> 3.0 GiB" in body
    assert "engine healthy:</span> no" in body
    assert "current jobs:</span> 17, 18" in body
    assert "gpu utilization" not in body
