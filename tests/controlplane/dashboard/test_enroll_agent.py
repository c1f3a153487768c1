"""The fleet page's enrollment: staff see the keys waiting (fingerprint shown)
and enroll, reject or revoke; nobody else sees or may."""

import pytest

from controlplane.fleet.models import Agent, EnrollmentRequest
from controlplane.fleet.tasks import record_heartbeat
from gpuagent import tasks
from gpuagent.artifacts import ArtifactStore
from tests.controlplane.conftest import sealed_beat


@pytest.fixture
def newcomer(db, tmp_path) -> tasks.Agent:
    agent = tasks.Agent(
        name="gpu-9",
        store=ArtifactStore(tmp_path / "artifacts"),
        signing_key=None,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
    )
    assert record_heartbeat(*sealed_beat(agent)) == "pending"
    return agent


@pytest.fixture
def staff(owner):
    owner.is_staff = True
    owner.save(update_fields=["is_staff"])
    return owner


def test_staff_see_the_waiting_key_with_its_fingerprint(client, staff, newcomer):
    client.force_login(staff)

    response = client.get("/fleet/")

    assert newcomer.fingerprint.encode() in response.content
    assert b"Agents waiting for enrollment" in response.content


def test_a_team_admin_sees_no_waiting_keys_and_may_not_enroll(client, owner, newcomer):
    client.force_login(owner)
    request = EnrollmentRequest.objects.get()

    page = client.get("/fleet/")
    posted = client.post(f"/fleet/enrollments/{request.pk}/enroll/", {})

    assert newcomer.fingerprint.encode() not in page.content
    assert posted.status_code == 403
    assert not Agent.objects.exists()


def test_staff_enroll_a_key_under_their_name_then_revoke_it(client, staff, newcomer):
    client.force_login(staff)
    request = EnrollmentRequest.objects.get()

    enrolled = client.post(
        f"/fleet/enrollments/{request.pk}/enroll/",
        {"name": "cpu-east-1", "pool_queue": "cpu"},
    )

    assert enrolled.status_code == 302
    agent = Agent.objects.get(name="cpu-east-1")
    assert (agent.pool_queue, agent.can_sign, agent.fingerprint) == (
        "cpu",
        False,
        newcomer.fingerprint,
    )
    client.post(f"/fleet/agents/{agent.pk}/revoke/")
    assert Agent.objects.get(pk=agent.pk).enrollment == "revoked"
    assert record_heartbeat(*sealed_beat(newcomer)) == "refused"


@pytest.mark.parametrize(
    "form, stored",
    [
        ({}, None),  # the form's default: the agent's own list decides
        ({"programs_mode": "none"}, []),
        (
            {"programs_mode": "list", "allowed_programs": "vllm\n\n  own-engine  \n"},
            ["vllm", "own-engine"],
        ),
    ],
)
def test_staff_enroll_a_key_with_the_external_backends_it_may_start(
    client, staff, newcomer, form, stored
):
    client.force_login(staff)
    request = EnrollmentRequest.objects.get()

    page = client.get("/fleet/")
    enrolled = client.post(
        f"/fleet/enrollments/{request.pk}/enroll/", {"name": "gpu-9", **form}
    )

    assert b'name="programs_mode"' in page.content
    assert enrolled.status_code == 302
    assert Agent.objects.get(name="gpu-9").allowed_programs == stored


def test_an_unknown_backends_choice_is_refused_by_name(client, staff, newcomer):
    client.force_login(staff)
    request = EnrollmentRequest.objects.get()

    answer = client.post(
        f"/fleet/enrollments/{request.pk}/enroll/",
        {"name": "gpu-9", "programs_mode": "anything"},
        follow=True,
    )

    assert b"allowed_programs must be a list" in answer.content
    assert not Agent.objects.exists()
