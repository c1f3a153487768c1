"""The devices an agent may serve on come from its enrollment, never a heartbeat:
the pending request shows what the agent reported, the operator enrolls all of
them or some (API and fleet page), and later beats report only the free memory
of the enrolled ones; a beat naming others is noted, not trusted."""

import pytest
from django.urls import reverse

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Agent, EnrollmentRequest
from controlplane.fleet.tasks import record_heartbeat
from gpuagent import tasks
from gpuagent.artifacts import ArtifactStore
from tests.controlplane.api.helpers import error_of, field_names
from tests.controlplane.conftest import sealed_beat

GIB = 2**30


def device(index: int, total_gib: int = 80, free_gib: int = 79) -> dict:
    return {
        "index": index,
        "model": "NVIDIA H100 80GB HBM3",
        "memory_total_bytes": total_gib * GIB,
        "memory_free_bytes": free_gib * GIB,
    }


@pytest.fixture
def staff_owner(owner):
    owner.is_staff = True
    owner.save(update_fields=["is_staff"])
    return owner


@pytest.fixture
def newcomer(db, tmp_path):
    """An agent that beat once reporting two GPUs: a pending enrollment."""
    agent = tasks.Agent(
        name="gpu-1",
        store=ArtifactStore(tmp_path / "artifacts"),
        signing_key=None,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="gpu-pool",
        threads=1,
    )
    beat = sealed_beat(agent, device="cuda", devices=[device(0), device(1)])
    assert record_heartbeat(*beat) == "pending"
    return agent


def url(agent, action="enroll") -> str:
    request = EnrollmentRequest.objects.get(fingerprint=agent.fingerprint)
    return f"/api/v1/agents/enrollments/{request.pk}/{action}"


def test_the_pending_request_shows_the_devices_the_agent_reported(
    api, admin_token, staff_owner, newcomer
):
    (listed,) = api.get("/api/v1/agents/enrollments", token=admin_token).json()

    assert listed["devices"] == [
        {"index": i, "model": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * GIB}
        for i in (0, 1)
    ]


def test_it_enrolls_every_reported_device_by_default(
    api, admin_token, staff_owner, newcomer
):
    response = api.post(url(newcomer), {}, token=admin_token)

    assert response.status_code == 200, response.content
    assert [d["index"] for d in response.json()["enrolled_devices"]] == [0, 1]


def test_it_enrolls_the_devices_the_operator_chose(
    api, admin_token, staff_owner, newcomer
):
    response = api.post(url(newcomer), {"devices": [1]}, token=admin_token)

    assert response.status_code == 200, response.content
    assert Agent.objects.get(name="gpu-1").device_indices == [1]


@pytest.mark.parametrize(
    ("devices", "message"),
    [([7], "reported no device 7"), ([0, 0], "distinct device indices")],
)
def test_it_refuses_a_device_the_agent_did_not_report(
    api, admin_token, staff_owner, newcomer, devices, message
):
    response = api.post(url(newcomer), {"devices": devices}, token=admin_token)

    error = error_of(response, 422, "validation_failed")
    assert message in error["message"]
    assert field_names(error) == {"devices"}
    assert not Agent.objects.filter(name="gpu-1").exists()


def test_beats_report_only_the_enrolled_devices_and_the_rest_is_noted(
    api, admin_token, staff_owner, newcomer
):
    api.post(url(newcomer), {"devices": [0]}, token=admin_token)
    # It now claims device 0 is bigger than enrolled, and two more devices.
    said = [device(0, total_gib=999, free_gib=500), device(1), device(2)]

    assert record_heartbeat(*sealed_beat(newcomer, devices=said)) == "online"
    assert record_heartbeat(*sealed_beat(newcomer, devices=said)) == "online"

    agent = Agent.objects.get(name="gpu-1")
    assert agent.device_indices == [0]
    (state,) = agent.devices
    assert state["memory_total_bytes"] == 80 * GIB  # the enrollment's
    assert state["memory_free_bytes"] == 80 * GIB  # capped at the enrolled total
    assert agent.devices_outside_enrollment == [1, 2]
    (noted,) = AuditEvent.objects.filter(verb="agent.devices_outside_enrollment")
    assert noted.after == {"devices": [1, 2]}


def test_the_fleet_page_enrolls_the_ticked_devices(client, staff_owner, newcomer):
    client.force_login(staff_owner)
    request = EnrollmentRequest.objects.get(fingerprint=newcomer.fingerprint)
    page = client.get(reverse("dashboard:fleet")).content.decode()
    assert 'name="devices" value="1" checked' in page

    client.post(
        reverse("dashboard:enroll-agent", args=[request.pk]),
        {
            "name": "gpu-1",
            "pool_queue": "gpu-pool",
            "devices_shown": "1",
            "devices": ["1"],
        },
    )

    assert Agent.objects.get(name="gpu-1").device_indices == [1]
