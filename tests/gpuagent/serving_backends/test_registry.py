"""Deployments' processes: started in their own group, stopped with SIGTERM then
SIGKILL, never left behind by a failed start, found again by a restarted agent."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from gpuagent.protocol import BackendSpec
from gpuagent.serving import (
    Registry,
    ServingError,
    check_rollback_target,
    deploy,
    loaded_deployments,
    recover_deployments,
    undeploy,
)
from tests.gpuagent.serving_backends.conftest import (
    REPO,
    free_port,
    new_marker,
    port_open,
    processes_with,
    spec_for,
    stand_in_backend,
)


def test_it_undeploys_idempotently_and_closes_the_port(approved, registry):
    marker = new_marker()
    result = deploy(
        approved.folder,
        spec_for(approved, stand_in_backend(), served_model_name=marker),
        registry=registry,
    )
    assert result.ok, result.error
    port = int(result.endpoint.rsplit(":", 1)[1])
    assert result.endpoint == f"http://127.0.0.1:{port}"
    assert port_open(port) and len(processes_with(marker)) == 1
    assert [d.deployment_id for d in loaded_deployments(registry)] == [
        result.deployment_id
    ]

    assert undeploy(result.deployment_id, registry=registry) is True
    assert undeploy(result.deployment_id, registry=registry) is False  # again: no-op

    assert not port_open(port) and processes_with(marker) == []
    assert loaded_deployments(registry) == []


def test_it_kills_a_server_that_ignores_sigterm_after_the_grace(approved, registry):
    marker = new_marker()
    result = deploy(
        approved.folder,
        spec_for(
            approved, stand_in_backend("--ignore-sigterm"), served_model_name=marker
        ),
        registry=registry,
    )
    assert result.ok, result.error

    t0 = time.monotonic()
    assert undeploy(result.deployment_id, registry=registry, grace_s=1.0)

    assert processes_with(marker) == []
    assert 1.0 <= time.monotonic() - t0 < 8.0  # waited the grace, then SIGKILL


def test_it_kills_the_child_when_health_never_comes(approved, registry):
    marker = new_marker()
    spec = spec_for(
        approved,
        stand_in_backend("--never-healthy"),
        served_model_name=marker,
        health_timeout_s=2,
    )

    t0 = time.monotonic()
    result = deploy(approved.folder, spec, registry=registry, stop_grace_s=2)

    assert not result.ok and result.error_code == "start-failed"
    assert "no healthy /health" in result.error and "within 2 s" in result.error
    assert time.monotonic() - t0 < 15
    assert processes_with(marker) == []  # nothing orphaned
    assert loaded_deployments(registry) == []


def test_it_reports_a_server_that_exits_with_its_log(approved, registry):
    spec = spec_for(
        approved,
        stand_in_backend("--no-such-flag"),
        served_model_name=new_marker(),
    )

    result = deploy(approved.folder, spec, registry=registry)

    assert not result.ok and result.error_code == "start-failed"
    assert "exited before answering /health" in result.error
    assert "unrecognized arguments: --no-such-flag" in result.error


def test_it_refuses_a_pinned_port_another_server_holds(approved, registry):
    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        spec = spec_for(
            approved, stand_in_backend(), served_model_name=new_marker(), port=port
        )

        result = deploy(approved.folder, spec, registry=registry)

    assert not result.ok and f"port {port} on 127.0.0.1 is in use" in result.error
    assert loaded_deployments(registry) == []


def test_a_restarted_agent_finds_its_servers_and_cleans_them_up(approved, tmp_path):
    state_dir = tmp_path / "artifacts" / "serving"
    marker = new_marker()
    spec = spec_for(approved, stand_in_backend(), served_model_name=marker)
    # The agent that deploys is another process, which then exits.
    script = (
        "import sys; from pathlib import Path\n"
        "from gpuagent.protocol import DeploySpec\n"
        "from gpuagent.serving import Registry, deploy\n"
        "spec = DeploySpec.model_validate_json(sys.stdin.read())\n"
        "r = deploy(Path(sys.argv[1]), spec, registry=Registry(sys.argv[2]))\n"
        "print(r.model_dump_json())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(approved.folder), str(state_dir)],
        input=spec.model_dump_json(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    result = json.loads(done.stdout)
    assert result["ok"], (result, done.stderr)
    port = int(result["endpoint"].rsplit(":", 1)[1])
    assert port_open(port)  # the server outlived the agent process

    registry = Registry(state_dir)  # the restarted agent
    found = loaded_deployments(registry)
    assert [d.deployment_id for d in found] == [result["deployment_id"]]
    assert found[0].served_model_name == marker and found[0].pid > 0

    assert recover_deployments(registry, stop=True) == found

    assert processes_with(marker) == [] and not port_open(port)
    assert loaded_deployments(registry) == []
    assert json.loads((state_dir / "deployments.json").read_text())["deployments"] == {}


def test_it_drops_records_of_dead_servers_and_never_signals_a_recycled_pid(
    approved, registry
):
    marker = new_marker()
    result = deploy(
        approved.folder,
        spec_for(approved, stand_in_backend(), served_model_name=marker),
        registry=registry,
    )
    record = registry.get(result.deployment_id)
    # The state file says our server is this test process (same pid, other start
    # time): nothing may signal it.
    fake = record.model_copy(
        update={
            "info": record.info.model_copy(
                update={"pid": os.getpid(), "deployment_id": "fake"}
            ),
        }
    )
    registry.add(fake)

    assert undeploy("fake", registry=registry) is False  # and we are still alive
    os.kill(record.info.pid, 9)  # the real server dies on its own
    time.sleep(0.5)

    assert loaded_deployments(registry) == []
    assert undeploy(result.deployment_id, registry=registry) is False


def test_it_reports_the_advertised_host_and_checks_health_locally(approved, registry):
    backend = stand_in_backend().model_copy(
        update={"advertise_host": "agent-7.example"}
    )
    result = deploy(
        approved.folder,
        spec_for(approved, backend, served_model_name=new_marker()),
        registry=registry,
    )

    assert result.ok, result.error
    assert result.endpoint.startswith("http://agent-7.example:")
    assert check_rollback_target(result.deployment_id, registry=registry).healthy


def test_a_redelivered_deploy_returns_the_running_server(approved, registry):
    marker = new_marker()
    spec = spec_for(approved, stand_in_backend(), served_model_name=marker)
    first = deploy(approved.folder, spec, registry=registry)

    again = deploy(approved.folder, spec, registry=registry)
    (approved.folder / "notes.txt").write_text("planted\n")
    tampered = deploy(approved.folder, spec, registry=registry)

    assert first.ok and again.ok, (first.error, again.error)
    assert again.deployment_id == first.deployment_id
    assert again.endpoint == first.endpoint
    assert not tampered.ok and tampered.extra == ["notes.txt"]
    assert len(processes_with(marker)) == 1  # never a second server


def test_a_redelivered_deploy_replaces_a_server_that_stopped_answering(
    approved, registry
):
    marker = new_marker()
    spec = spec_for(approved, stand_in_backend(), served_model_name=marker)
    first = deploy(approved.folder, spec, registry=registry)
    pid = registry.get(first.deployment_id).info.pid
    os.kill(pid, signal.SIGSTOP)  # alive, but /health never answers
    try:
        again = deploy(approved.folder, spec, registry=registry)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    assert again.ok and again.deployment_id != first.deployment_id, again.error
    assert [d.deployment_id for d in loaded_deployments(registry)] == [
        again.deployment_id
    ]
    assert len(processes_with(marker)) == 1


def test_it_refuses_to_guess_over_a_corrupt_state_or_quarantine_file(
    approved, registry
):
    spec = spec_for(approved, stand_in_backend(), served_model_name=new_marker())
    (registry.state_dir / "quarantine.json").write_text("{not json")

    result = deploy(approved.folder, spec, registry=registry)

    assert not result.ok and "cannot read the quarantine file" in result.error
    (registry.state_dir / "quarantine.json").unlink()
    (registry.state_dir / "deployments.json").write_text('{"format": "other"}')
    with pytest.raises(ServingError, match="cannot read the deployments state file"):
        loaded_deployments(registry)
    (registry.state_dir / "deployments.json").unlink()


def test_it_reports_a_program_that_does_not_exist(approved, registry):
    backend = BackendSpec(kind="external", command_template="no-such-engine {port}")

    result = deploy(approved.folder, spec_for(approved, backend), registry=registry)

    assert not result.ok and result.error_code == "start-failed"
    assert "cannot start 'no-such-engine'" in result.error
