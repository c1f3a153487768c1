"""The API shows each deployment's placement (GET /deployments) and whether an
environment's rollback target is warm or cold and about how long a rollback
would take (GET /environments)."""

from datetime import timedelta

from django.utils import timezone

from controlplane.fleet.models import Deployment
from controlplane.releases.models import Job

GIB = 2**30
PLACEMENT = {
    "devices": [1],
    "memory_budget_bytes": 30 * GIB,
    "device_memory_total_bytes": 80 * GIB,
    "stop_first": ["srv-1"],
}


def test_it_shows_placements_and_a_cold_rollback_target(
    api, owner_token, make_release, environment
):
    now = timezone.now()
    old = make_release("1.0.0", state="superseded")
    new = make_release("2.0.0", state="live")
    Deployment.objects.create(
        release=old,
        environment=environment,
        state="superseded",
        serving_id="srv-1",
        started=now - timedelta(hours=1),
        ended=now,
        unloaded=now,  # stopped to make room for the new one
    )
    Deployment.objects.create(
        release=new,
        environment=environment,
        state="live",
        serving_id="srv-2",
        placement=PLACEMENT,
        memory_need_bytes=29 * GIB,
        placement_note="on gpu-1 devices 1; stopped first to make room: 1.0.0",
    )
    Job.objects.create(
        release=old,
        kind="deploy",
        state="succeeded",
        started=now - timedelta(seconds=95),
        finished=now,
    )

    deployments = api.get("/api/v1/deployments", token=owner_token).json()["items"]
    environments = api.get("/api/v1/environments", token=owner_token).json()["items"]

    live, superseded = deployments
    assert live["placement"] == {
        "devices": [1],
        "memory_budget_bytes": 30 * GIB,
        "memory_need_bytes": 29 * GIB,
        "note": "on gpu-1 devices 1; stopped first to make room: 1.0.0",
        "warm": True,
        "unloaded": None,
    }
    assert superseded["placement"]["warm"] is False
    (staging,) = environments
    target = staging["rollback_target"]
    assert (target["release_id"], target["warm"]) == (old.pk, False)
    assert target["estimate_s"] == 95.0
    assert "its own last deploy" in target["basis"]
