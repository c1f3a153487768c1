"""The agent process (gpuagent.worker): who it is, which start of it this is, and
its heartbeat, sent through a real (embedded SQLAlchemy) broker."""

import ssl

import pytest

from gpuagent import worker
from tests.test_layering import imported_modules, is_within


@pytest.fixture
def me(tmp_path, monkeypatch) -> worker.Agent:
    """This process's agent, as `python -m gpuagent run` would configure it."""
    agent = worker.agent_from_environment(
        {
            "GPUAGENT_NAME": "gpu-7",
            "GPUAGENT_ARTIFACTS": str(tmp_path / "artifacts"),
            "GPUAGENT_CONTROLPLANE_QUEUE": f"cp-{tmp_path.name}",
        }
    )
    monkeypatch.setattr(worker, "_agent", agent)
    return agent


def test_it_never_imports_the_job_handlers():
    imports = imported_modules("gpuagent")

    assert not any(
        is_within(name, "gpuagent.tasks") for name in imports["gpuagent/worker.py"]
    )
    assert "gpuagent.worker" in imports["gpuagent/tasks.py"]  # one way


def test_each_start_of_an_agent_is_another_incarnation(me):
    again = worker.agent_from_environment({"GPUAGENT_NAME": "gpu-7"})

    assert me.incarnation != again.incarnation
    assert len(me.incarnation) == 32
    assert again.started >= me.started


def test_it_beats_with_its_incarnation(me):
    me.running_jobs.add(41)

    beat = worker.heartbeat()

    assert (beat.agent, beat.queue) == ("gpu-7", "agent.gpu-7")
    assert (beat.incarnation, beat.started) == (me.incarnation, me.started)
    assert beat.running_jobs == [41]


def test_it_sends_the_first_beat_before_it_returns(me, tmp_path):
    app = worker.make_app(f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}")

    stop = worker.start_heartbeat(app)
    stop.set()

    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(me.controlplane_queue)
        message = queue.get(block=False)  # there already, not on its way
        queue.close()
    assert message.headers["task"] == worker.RECORD_HEARTBEAT
    (sent,), _, _ = message.decode()
    assert sent["incarnation"] == me.incarnation


def test_it_checks_the_certificate_of_a_rediss_broker():
    url = "rediss://agent-gpu-1:s3cret@redis.internal:6380/0"

    checked = worker.make_app(url).connection_for_write().ssl
    with_ca = worker.make_app(url + "?ssl_ca_certs=/ca.pem").connection_for_write()

    assert checked == {"ssl_cert_reqs": ssl.CERT_REQUIRED}  # kombu's own: CERT_NONE
    assert with_ca.ssl == {"ssl_ca_certs": "/ca.pem"}  # redis-py then requires
    assert not worker.make_app("redis://redis.internal/0").connection_for_write().ssl


def test_it_keeps_its_unacknowledged_messages_under_keys_of_its_own():
    app = worker.make_app("rediss://agent-gpu-1:s3cret@redis.internal:6380/0", "gpu-1")

    assert app.conf.broker_transport_options == {
        "unacked_key": "unacked.agent.gpu-1",
        "unacked_index_key": "unacked_index.agent.gpu-1",
        "unacked_mutex_key": "unacked_mutex.agent.gpu-1",
    }
    assert app.conf.worker_enable_remote_control is False
