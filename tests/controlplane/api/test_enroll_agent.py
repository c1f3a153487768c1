"""POST /api/v1/agents/enrollments/{id}/enroll (and list, reject, revoke): only
the platform's operators (staff, admin-scope token) enroll agents; the name, pool
and capabilities are theirs, never what the agent's beat said."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Agent, EnrollmentRequest
from controlplane.fleet.tasks import record_heartbeat
from gpuagent import tasks
from gpuagent.artifacts import ArtifactStore
from tests.controlplane.api.helpers import error_of
from tests.controlplane.conftest import sealed_beat


@pytest.fixture
def staff_owner(owner):
    owner.is_staff = True
    owner.save(update_fields=["is_staff"])
    return owner


@pytest.fixture
def newcomer(db, tmp_path):
    """An agent that beat once: a pending enrollment, nothing more. It says it is
    "gpu-1" in the pool "gpu-pool" and may sign."""
    from gpuagent.integrity.keys import ensure_key_pair

    key = tmp_path / "signing.pem"
    ensure_key_pair(key)
    agent = tasks.Agent(
        name="gpu-1",
        store=ArtifactStore(tmp_path / "artifacts"),
        signing_key=key,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="gpu-pool",
        threads=1,
    )
    assert record_heartbeat(*sealed_beat(agent)) == "pending"
    return agent


def url(agent, action="enroll") -> str:
    request = EnrollmentRequest.objects.get(fingerprint=agent.fingerprint)
    return f"/api/v1/agents/enrollments/{request.pk}/{action}"


def test_it_lists_pending_keys_with_their_fingerprint(
    api, admin_token, staff_owner, newcomer
):
    response = api.get("/api/v1/agents/enrollments", token=admin_token)

    assert response.status_code == 200, response.content
    (listed,) = response.json()
    assert listed["fingerprint"] == newcomer.fingerprint
    assert len(listed["fingerprint"]) == 64
    assert (listed["requested_name"], listed["state"]) == ("gpu-1", "pending")
    assert not Agent.objects.exists()  # a beat alone makes no agent


def test_it_lists_no_keys_to_a_team_admin_who_is_not_staff(
    api, make_token, owner, newcomer
):
    response = api.get("/api/v1/agents/enrollments", token=make_token(owner, "read"))

    assert response.json() == []


def test_it_enrolls_a_key_under_the_operators_name_pool_and_capabilities(
    api, admin_token, staff_owner, newcomer
):
    body = {"name": "h100-a", "pool_queue": "h100", "can_sign": True}

    response = api.post(url(newcomer), body, token=admin_token)

    assert response.status_code == 200, response.content
    agent = Agent.objects.get(name="h100-a")
    assert (agent.queue, agent.pool_queue, agent.can_sign) == (
        "agent.h100-a",
        "h100",
        True,
    )
    assert agent.fingerprint == newcomer.fingerprint
    assert AuditEvent.objects.get(verb="agent.enrolled").actor_user == staff_owner
    # its next beat, still saying "gpu-1" in "gpu-pool", changes none of it
    assert record_heartbeat(*sealed_beat(newcomer)) == "online"
    agent.refresh_from_db()
    assert (agent.name, agent.queue, agent.capabilities["pool_queue"]) == (
        "h100-a",
        "agent.h100-a",
        "h100",
    )


def test_it_refuses_a_team_admin_who_is_not_staff(api, admin_token, owner, newcomer):
    response = api.post(url(newcomer), {}, token=admin_token)

    assert "staff" in error_of(response, 403, "forbidden")["message"]
    assert not Agent.objects.exists()


def test_it_needs_the_admin_scope(api, make_token, staff_owner, newcomer):
    token = make_token(staff_owner, "read", "approve")

    response = api.post(url(newcomer), {}, token=token)

    assert error_of(response, 403, "missing_scope")["scope"] == "admin"


def test_it_refuses_an_unknown_field(api, admin_token, staff_owner, newcomer):
    response = api.post(url(newcomer), {"queue": "agent.x"}, token=admin_token)

    assert response.status_code == 422, response.content
    assert "queue" in response.content.decode()


def test_it_refuses_may_sign_for_an_agent_that_presented_no_signing_key(
    api, admin_token, staff_owner, tmp_path
):
    agent = tasks.Agent(
        name="plain",
        store=ArtifactStore(tmp_path / "plain"),
        signing_key=None,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
    )
    record_heartbeat(*sealed_beat(agent))

    response = api.post(url(agent), {"can_sign": True}, token=admin_token)

    assert error_of(response, 422, "validation_failed")["message"].startswith(
        "this agent presented no signing key"
    )


def test_it_rejects_a_key(api, admin_token, staff_owner, newcomer):
    response = api.post(url(newcomer, "reject"), token=admin_token)

    assert response.json()["state"] == "rejected"
    # rejected: its beats are refused, no agent made
    assert record_heartbeat(*sealed_beat(newcomer)) == "refused"
    assert not Agent.objects.exists()


def test_a_revoked_agents_beats_are_refused_at_once(
    api, admin_token, staff_owner, newcomer
):
    api.post(url(newcomer), {}, token=admin_token)
    assert record_heartbeat(*sealed_beat(newcomer)) == "online"

    response = api.post("/api/v1/agents/gpu-1/revoke", token=admin_token)

    assert response.status_code == 200, response.content
    assert response.json()["enrollment"] == "revoked"
    assert record_heartbeat(*sealed_beat(newcomer)) == "refused"
    assert Agent.objects.get(name="gpu-1").state == "offline"
    refused = AuditEvent.objects.filter(verb="agent.message_refused").last()
    assert "revoked" in refused.after["reason"]
