from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.errors import ValidationFailed
from controlplane.fleet.actions import (
    do_record_agent_heartbeat,
    do_register_agent,
    do_set_agent_state,
)
from controlplane.fleet.models import Agent
from gpuagent.protocol import DeploymentInfo

SERVED = DeploymentInfo(
    deployment_id="ab12cd34ef56-0a1b2c3d",
    manifest_digest="sha256:" + "ab" * 32,
    endpoint="http://10.0.0.7:8100",
    backend="engine",
    served_model_name="candidate",
    model_dir="/var/artifacts/candidates/x",
    pid=4242,
    started="2026-01-02T03:04:05Z",
)


def test_it_registers_an_agent_and_updates_it_on_reregistration(db):
    agent = do_register_agent("gpu-node-1", queue="agent.gpu-node-1")

    again = do_register_agent(
        "gpu-node-1",
        queue="agent.gpu-node-1",
        gpu_model="H100",
        gpu_memory_bytes=80 * 2**30,
        capabilities={"kv_cache_dtypes": ["fp8", "int8"]},
    )

    assert again.pk == agent.pk
    stored = Agent.objects.get()
    assert (stored.gpu_model, stored.state) == ("H100", "online")
    assert stored.capabilities == {"kv_cache_dtypes": ["fp8", "int8"]}
    assert AuditEvent.objects.filter(verb="agent.registered").count() == 2


def test_it_refuses_bad_agent_fields(db):
    with pytest.raises(ValidationFailed):
        do_register_agent("", queue="q")
    with pytest.raises(ValidationFailed):
        do_register_agent("a", queue="q", gpu_memory_bytes=-1)


def test_it_records_heartbeats(db):
    agent = do_register_agent("cpu-1", queue="agent.cpu-1")
    Agent.objects.filter(pk=agent.pk).update(state="offline", last_heartbeat=None)

    do_record_agent_heartbeat(agent)

    stored = Agent.objects.get(pk=agent.pk)
    assert stored.state == "online"
    assert stored.last_heartbeat is not None


def test_it_drains_an_agent(db, owner):
    agent = do_register_agent("cpu-1", queue="agent.cpu-1")

    do_set_agent_state(agent, "draining", actor=owner)

    assert Agent.objects.get(pk=agent.pk).state == "draining"
    with pytest.raises(ValidationFailed):
        do_set_agent_state(agent, "asleep", actor=owner)


def beat(**overrides):
    from gpuagent.protocol import Heartbeat

    fields = dict(
        agent="gpu-1",
        queue="agent.gpu-1",
        pool_queue="agents",
        device="cuda",
        gpu_model="NVIDIA H200",
        memory_total_bytes=141 * 2**30,
        memory_free_bytes=100 * 2**30,
        running_jobs=[7],
        deployments=[SERVED],
        can_sign=True,
    )
    fields.update(overrides)
    return Heartbeat(**fields)


def test_it_registers_an_agent_on_its_first_heartbeat_with_what_it_reports(db):
    from controlplane.fleet.actions import do_record_heartbeat

    agent = do_record_heartbeat(beat())

    stored = Agent.objects.get(pk=agent.pk)
    assert (stored.state, stored.device, stored.gpu_model) == (
        "online",
        "cuda",
        "NVIDIA H200",
    )
    assert stored.gpu_memory_bytes == 141 * 2**30
    assert stored.gpu_memory_free_bytes == 100 * 2**30
    assert (stored.running_jobs, stored.loaded_deployments) == (
        [7],
        [SERVED.model_dump(mode="json")],
    )
    assert stored.capabilities == {"can_sign": True, "pool_queue": "agents"}


def test_a_heartbeat_brings_an_offline_agent_back_but_not_a_draining_one(db, owner):
    from controlplane.fleet.actions import do_record_heartbeat

    agent = do_record_heartbeat(beat())
    Agent.objects.filter(pk=agent.pk).update(state="offline")
    assert do_record_heartbeat(beat(running_jobs=[])).state == "online"

    do_set_agent_state(agent, "draining", actor=owner)

    assert do_record_heartbeat(beat()).state == "draining"


def test_it_records_the_incarnation_an_agent_reports_first_without_a_restart(db):
    from controlplane.fleet.actions import do_record_heartbeat

    started = timezone.now() - timedelta(seconds=5)

    agent = do_record_heartbeat(beat(incarnation="a" * 32, started=started))

    stored = Agent.objects.get(pk=agent.pk)
    assert (stored.incarnation, stored.started) == ("a" * 32, started)
    assert not AuditEvent.objects.filter(verb="agent.restarted").exists()


def test_it_records_a_new_incarnation_of_an_agent_as_a_restart(db):
    from controlplane.fleet.actions import do_record_heartbeat

    first_started = timezone.now() - timedelta(minutes=5)
    do_record_heartbeat(beat(incarnation="a" * 32, started=first_started))
    do_record_heartbeat(beat(incarnation="a" * 32, started=first_started))
    restarted = timezone.now()

    agent = do_record_heartbeat(beat(incarnation="b" * 32, started=restarted))

    stored = Agent.objects.get(pk=agent.pk)
    assert (stored.incarnation, stored.started) == ("b" * 32, restarted)
    (event,) = AuditEvent.objects.filter(verb="agent.restarted")
    assert event.before == {
        "incarnation": "a" * 32,
        "started": first_started.isoformat(),
    }
    assert event.after == {"incarnation": "b" * 32, "started": restarted.isoformat()}


def test_a_late_beat_of_an_earlier_incarnation_changes_nothing(db):
    from controlplane.fleet.actions import do_record_heartbeat

    earlier = timezone.now() - timedelta(minutes=5)
    do_record_heartbeat(beat(incarnation="a" * 32, started=earlier, running_jobs=[7]))
    do_record_heartbeat(
        beat(incarnation="b" * 32, started=timezone.now(), running_jobs=[])
    )
    before = Agent.objects.get().to_dict()

    do_record_heartbeat(beat(incarnation="a" * 32, started=earlier, running_jobs=[7]))

    assert Agent.objects.get().to_dict() == before
    assert AuditEvent.objects.filter(verb="agent.restarted").count() == 1
