"""Server processes: the port's listener must be the server started, and servers
do not inherit the agent's secrets."""

import subprocess
import sys
import time

import pytest

from gpuagent.serving import StartError, process
from gpuagent.serving.deploy import server_env
from tests.gpuagent.serving_backends.conftest import (
    HEALTH_SERVER,
    free_port,
    port_open,
)


@pytest.fixture
def foreign_server():
    """A healthy server of someone else's on a free port: (port, pid)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(HEALTH_SERVER), "--port", str(port), "--name", "m"]
    )
    deadline = time.monotonic() + 20
    while not port_open(port):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    yield port, proc.pid
    proc.kill()
    proc.wait(10)


def test_it_names_the_listeners_of_a_port(foreign_server):
    port, pid = foreign_server

    assert process.port_listeners(port) == {pid}
    assert process.port_listeners(free_port()) == set()


def test_it_does_not_take_another_servers_health_for_its_own(foreign_server, tmp_path):
    # The race pick_port cannot close: the server started could not bind the port
    # it was given, and another one answers there.
    port, foreign_pid = foreign_server
    log = tmp_path / "server.log"
    pid, started = process.spawn(
        [sys.executable, "-c", "import time; time.sleep(60)"], log, server_env()
    )
    try:
        with pytest.raises(StartError) as info:
            process.wait_healthy(
                f"http://127.0.0.1:{port}",
                pid,
                started,
                10,
                served_model_name="m",
                log_path=log,
            )
    finally:
        process.stop(pid, started, grace_s=2)

    assert f"held by process(es) [{foreign_pid}]" in str(info.value)
    assert not process.is_running(pid, started)


def test_it_keeps_the_agents_secrets_from_servers():
    env = server_env(
        {
            "PATH": "/usr/bin",
            "CUDA_VISIBLE_DEVICES": "0,1",
            "CELERY_BROKER_URL": "redis://:pw@broker:6379/0",
            "DATABASE_URL": "postgres://u:pw@db/rg",
            "SECRET_KEY": "s",
            "HF_TOKEN": "t",
            "AWS_SECRET_ACCESS_KEY": "k",
            "RELEASEGATE_SIGNING_KEY": "k",
        }
    )

    assert env == {
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def test_it_keeps_torch_out_of_the_agent_process():
    import subprocess as sp

    code = "import sys, gpuagent.serving; print('torch' in sys.modules)"
    done = sp.run([sys.executable, "-c", code], capture_output=True, text=True)

    assert done.stdout.strip() == "False", done.stderr
