"""Placement in the deploy pipeline: each deploy job is placed on the devices the
agent was enrolled with, beside the servers warm there (controlplane.releases
.placing), and carries its devices and budget to that agent; a release that
doesn't fit beside the previous one makes it cold, and a rollback to it
restarts it; one that fits keeps it warm and a rollback reuses its server."""

import shutil
from pathlib import Path

import pytest
from django.urls import reverse

from controlplane.fleet.models import Agent, Deployment
from controlplane.fleet.placement import GIB, USABLE_FRACTION
from controlplane.fleet.tasks import record_heartbeat
from controlplane.releases import pipeline, tasks
from controlplane.releases.actions.approvals import do_approve_release
from controlplane.releases.actions.rollbacks import do_rollback_environment
from controlplane.releases.models import Artifact, Job, Release
from controlplane.releases.timings import rollback_readiness
from gpuagent import tasks as tasks_module
from gpuagent.protocol import DeployResult
from gpuagent.serving import undeploy
from tests.controlplane.conftest import LocalAgent, enroll, sealed_beat
from tests.controlplane.releases.test_pipeline import (
    BF16,
    DEMO_MODEL,
    promote_to_approval,
)

ENGINE_KV = int(0.05 * GIB)


def h100s(count: int) -> list[dict]:
    return [
        {
            "index": i,
            "model": "NVIDIA H100 80GB HBM3",
            "memory_total_bytes": 80 * GIB,
            "memory_free_bytes": 79 * GIB,
        }
        for i in range(count)
    ]


@pytest.fixture
def agent_with(db, tmp_path, queued, controlplane_key):
    """agent_with(n): "local" enrolled with the n H100s it reported (or with the
    device dicts of a list)."""

    def make(devices: int | list[dict]) -> LocalAgent:
        reported = h100s(devices) if isinstance(devices, int) else devices
        return LocalAgent(tmp_path, controlplane_key, devices=reported)

    return make


@pytest.fixture
def release_of(make_release):
    """release_of(weights_bytes, environment=None): an approved release whose
    signed files total `weights_bytes`."""

    def make(weights_bytes: int, **fields) -> Release:
        release = make_release(state="approved", **fields)
        Artifact.objects.create(
            release=release,
            path="model.safetensors",
            size_bytes=weights_bytes,
            digest="sha256:" + "0" * 64,
        )
        return release

    return make


@pytest.fixture
def demo_release(make_release, make_source):
    """A release of a copy of the demo model, compressed for real by the agent."""
    folder = make_source("model")
    for path in DEMO_MODEL.iterdir():
        if path.is_file():
            shutil.copyfile(path, folder / path.name)
    return make_release(source_uri=folder.as_uri(), recipe=BF16)


def engine_need(weights_bytes: int) -> int:
    # The test agent beats as a CPU agent: the engine holds float32 weights there.
    return 2 * weights_bytes + ENGINE_KV


def send_deploy(release, agent):
    assert tasks.run_deployment(release.pk) == "deploying"
    (message, request), *_ = agent.pending("deploy")
    return message, request


def go_live(release, agent, serving_id: str):
    message, request = send_deploy(release, agent)
    agent.answer(
        "deploy",
        DeployResult(
            ok=True,
            endpoint=f"http://gpu:{8100 + release.pk}",
            deployment_id=serving_id,
        ),
    )
    assert Release.objects.get(pk=release.pk).state == "live"
    return message, request


def test_a_pair_on_one_agent_gets_disjoint_devices(agent_with, release_of):
    agent = agent_with(2)
    first, second = release_of(20 * GIB), release_of(20 * GIB)
    _, first_request = go_live(first, agent, "srv-1")

    message, request = go_live(second, agent, "srv-2")

    assert first_request.placement.devices == [0]
    assert request.placement.devices == [1]
    assert request.placement.stop_first == []
    assert request.placement.memory_budget_bytes == engine_need(20 * GIB)
    assert request.placement.device_memory_total_bytes == 80 * GIB
    assert message.queue == "agent.local"  # the agent it was placed on
    old = first.deployments.get()
    assert (old.state, old.warm) == ("superseded", True)  # the rollback target
    assert rollback_readiness(old)["warm"] is True


def test_a_pair_on_one_device_gets_budgets_that_fit(agent_with, release_of):
    agent = agent_with(1)
    first, second = release_of(15 * GIB), release_of(15 * GIB)
    go_live(first, agent, "srv-1")

    _, request = go_live(second, agent, "srv-2")

    budgets = [d.memory_budget_bytes for d in Deployment.objects.all()]
    assert request.placement.devices == [0] and request.placement.stop_first == []
    assert budgets == [engine_need(15 * GIB)] * 2
    assert sum(budgets) <= 80 * GIB * USABLE_FRACTION
    assert first.deployments.get().warm


def test_one_that_does_not_fit_makes_the_previous_cold_and_a_rollback_restarts_it(
    agent_with, release_of, environment, teammate
):
    agent = agent_with(1)
    first, second = release_of(20 * GIB), release_of(20 * GIB)
    go_live(first, agent, "srv-1")

    _, request = go_live(second, agent, "srv-2")

    # Two need 80 GiB of the 72 GiB the device hands out: the live one stops
    # before the new one starts (a cold swap), kept verified on disk.
    assert request.placement.devices == [0]
    assert request.placement.stop_first == ["srv-1"]
    old = first.deployments.get()
    assert old.state == "superseded" and not old.warm and old.unloaded is not None
    assert "stopped first to make room" in second.deployments.get().placement_note
    assert agent.pending("undeploy") == []  # stopped already: no undeploy job
    readiness = rollback_readiness(old)
    assert readiness["warm"] is False
    deploy_job = first.jobs.get(kind="deploy")
    assert readiness["estimate_s"] == round(deploy_job.duration_s, 1)

    do_rollback_environment(environment, teammate)
    _, rollback = send_deploy(first, agent)

    # A restart: a fresh placement that stops the rolled-back server first.
    assert rollback.placement.devices == [0]
    assert rollback.placement.stop_first == ["srv-2"]
    restarted = first.deployments.get(state="deploying")
    assert not restarted.placement_note.startswith("warm")
    assert not second.deployments.get().warm
    agent.answer(
        "deploy", DeployResult(ok=True, endpoint="http://gpu:1", deployment_id="srv-3")
    )
    assert Release.objects.get(pk=first.pk).state == "live"


def test_a_failed_cold_swap_says_what_it_stopped(agent_with, release_of):
    agent = agent_with(1)
    first, second = release_of(20 * GIB), release_of(20 * GIB)
    go_live(first, agent, "srv-1")
    send_deploy(second, agent)

    agent.answer("deploy", error="the server did not answer /health")

    failed = second.deployments.get()
    assert failed.state == "failed"
    assert "stopped srv-1 first to make room" in failed.reason
    assert not first.deployments.get().warm  # the page shows it cold


def test_a_rollback_to_a_warm_target_goes_back_to_its_server(
    agent_with, release_of, environment, teammate
):
    agent = agent_with(2)
    first, second = release_of(20 * GIB), release_of(20 * GIB)
    _, first_request = go_live(first, agent, "srv-1")
    go_live(second, agent, "srv-2")

    do_rollback_environment(environment, teammate)
    _, rollback = send_deploy(first, agent)

    assert rollback.placement == first_request.placement  # its own devices again
    assert first.deployments.get(state="deploying").placement_note.startswith("warm")


def test_a_release_no_agent_has_room_for_fails_without_a_job(
    agent_with, release_of, make_environment, environment
):
    agent = agent_with(1)
    production = make_environment("production")
    go_live(release_of(30 * GIB, target_environment=production), agent, "srv-p")
    staging = release_of(20 * GIB)

    assert tasks.run_deployment(staging.pk) == "failed"

    deployment = staging.deployments.get()
    assert deployment.state == "failed"
    assert "no agent has room for it" in deployment.reason
    assert "other environments' servers hold" in deployment.reason
    assert agent.pending("deploy") == []


def test_the_free_memory_the_agent_reports_bounds_its_placement(agent_with, release_of):
    agent = agent_with(2)
    # Something else holds most of device 0: its beat says so.
    busy = [{**h100s(2)[0], "memory_free_bytes": 10 * GIB}, h100s(2)[1]]
    assert record_heartbeat(*sealed_beat(agent.agent, devices=busy)) == "online"

    _, request = send_deploy(release_of(10 * GIB), agent)

    assert request.placement.devices == [1]


def test_a_deploy_resent_away_from_its_agent_is_placed_again(
    agent_with, release_of, tmp_path
):
    local = agent_with(1)
    other = tasks_module.Agent(
        name="gpu-2",
        store=local.agent.store,
        signing_key=None,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
        controlplane_keys=local.agent.controlplane_keys,
    )
    gpu2 = enroll(other, reported_devices=h100s(1))
    release = release_of(20 * GIB)
    message, request = send_deploy(release, local)
    assert message.queue == "agent.gpu-2"  # first by name
    job = release.jobs.get(kind="deploy")
    Job.objects.filter(pk=job.pk).update(agent=gpu2)
    Agent.objects.filter(pk=gpu2.pk).update(state="offline")

    assert pipeline.retry_or_fail(job, "agent gpu-2 stopped sending heartbeats") == (
        "retried"
    )

    (message, resent), *_ = local.pending("deploy")[1:]
    assert message.queue == "agent.local"
    assert resent.attempt == 2 and resent.placement.devices == [0]
    assert release.deployments.get().agent.name == "local"


def test_an_unplaceable_release_is_deployed_on_the_whole_machine_as_before(
    local_agent, make_release
):
    release = make_release(state="approved")  # no weight size recorded; no devices

    _, request = send_deploy(release, local_agent)

    assert request.placement is None
    assert "not placed" in release.deployments.get().placement_note


def test_the_environments_page_says_warm_or_cold_and_how_long(
    agent_with, release_of, client, owner, environment
):
    agent = agent_with(1)
    first, second = release_of(20 * GIB), release_of(20 * GIB)
    go_live(first, agent, "srv-1")
    go_live(second, agent, "srv-2")
    client.force_login(owner)

    page = client.get(reverse("dashboard:environment-list")).content.decode()

    assert "Cold</strong>: a rollback takes about" in page
    assert "restarted from its verified copy on disk" in page
    assert "devices 0, 40.0 GiB each" in page


@pytest.mark.timeout(300)
def test_the_agents_engine_is_started_on_the_placed_device_and_budget(
    agent_with, demo_release, teammate, monkeypatch
):
    """The whole path on a CPU: the control plane places the deploy job, the
    agent's deploy (gpuagent.tasks, the task's own code) starts the engine, and
    the started process sees the placement's device and budget."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch references
    gpu3 = {**h100s(1)[0], "index": 3}
    agent = agent_with([gpu3])
    promote_to_approval(demo_release, agent)
    do_approve_release(demo_release, teammate)
    assert tasks.run_deployment(demo_release.pk) == "deploying"
    registry = agent.agent.registry
    try:
        (result,) = agent.work(kinds=("deploy",))

        assert result.ok, result.error
        deployment = demo_release.deployments.get()
        assert deployment.state == "live"
        assert deployment.devices == [3]
        weights = demo_release.jobs.get(kind="compress").result["report"][
            "expected_gpu_weight_bytes"
        ]
        assert deployment.memory_budget_bytes == engine_need(weights)
        (record,) = registry.records()
        environ = Path(f"/proc/{record.info.pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=3" in environ
        argv = Path(f"/proc/{record.info.pid}/cmdline").read_bytes().split(b"\0")
        budget = argv[argv.index(b"--memory-budget-bytes") + 1]
        assert int(budget) == deployment.memory_budget_bytes
    finally:
        for record in registry.records():
            undeploy(record.info.deployment_id, registry=registry, grace_s=5)


@pytest.mark.parametrize("allowed", [["own-engine"], []])
def test_an_external_deploy_is_placed_only_on_an_agent_enrolled_for_its_command(
    agent_with, release_of, environment, owner, operator, allowed
):
    from controlplane.fleet.actions import do_set_serving_backend, do_set_serving_preset
    from tests.controlplane.releases.test_serving_backend import ENGINE_TEMPLATE

    do_set_serving_preset("own-engine", ENGINE_TEMPLATE, actor=operator)
    do_set_serving_backend(
        environment, {"kind": "external", "preset": "own-engine"}, actor=owner
    )
    agent = agent_with(2)
    Agent.objects.filter(name="local").update(allowed_programs=allowed)
    # "checker" has no devices enrolled and may start no external backend
    Agent.objects.filter(name="checker").update(allowed_programs=[])
    release = release_of(20 * GIB)

    state = tasks.run_deployment(release.pk)

    deployment = Deployment.objects.get(release=release)
    if allowed:
        assert state == "deploying"
        (message, request), *_ = agent.pending("deploy")
        assert message.queue == "agent.local"
        assert deployment.agent.name == "local"
        assert request.placement.devices == [0]
    else:  # no agent may start it: nothing placed or sent
        assert state == "failed"
        assert agent.pending("deploy") == []
        assert deployment.placement is None
        assert deployment.state == "failed"
