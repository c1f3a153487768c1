"""The agent process (gpuagent.worker): who it is, which start of it this is, and
its heartbeat, sent through a real (embedded SQLAlchemy) broker."""

import ssl

import pytest

from gpuagent import worker
from gpuagent.integrity import identity
from gpuagent.protocol import Seal
from tests.test_layering import imported_modules, is_within


@pytest.fixture
def me(tmp_path, monkeypatch) -> worker.Agent:
    """This process's agent, as `python -m gpuagent run` would configure it."""
    agent = worker.agent_from_environment(
        {
            "GPUAGENT_NAME": "gpu-7",
            "GPUAGENT_ARTIFACTS": str(tmp_path / "artifacts"),
            "GPUAGENT_CONTROLPLANE_QUEUE": f"cp-{tmp_path.name}",
            "GPUAGENT_STATE_DIR": str(tmp_path / "state"),
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


def test_it_reports_each_device_and_on_a_cpu_the_host_as_one(me, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(worker, "memory", lambda: ("cpu", "CPU test", 64, 48))

    beat = worker.heartbeat()

    (device,) = beat.devices
    assert (device.index, device.model) == (0, "CPU test")
    assert (device.memory_total_bytes, device.memory_free_bytes) == (64, 48)
    assert (beat.device, beat.memory_total_bytes) == ("cpu", 64)  # as before


def test_it_sends_the_first_beat_before_it_returns(me, tmp_path):
    app = worker.make_app(f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}")

    stop = worker.start_heartbeat(app)
    stop.set()

    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(me.controlplane_queue)
        message = queue.get(block=False)  # there already, not on its way
        queue.close()
    assert message.headers["task"] == worker.RECORD_HEARTBEAT
    (sent, seal), _, _ = message.decode()
    assert sent["incarnation"] == me.incarnation
    # sealed by this agent's own key, over this very beat
    identity.check_seal(
        Seal.model_validate(seal),
        identity.public_raw(me.identity),
        sent,
        type="heartbeat",
    )
    assert sent["public_key"] == identity.public_raw(me.identity).hex()


def test_it_creates_its_identity_key_on_first_start_readable_by_it_alone(me):
    key_path = me.identity_key_path

    fingerprint = me.fingerprint

    assert key_path.is_file()
    assert key_path.stat().st_mode & 0o777 == 0o600
    again = worker.agent_from_environment(
        {"GPUAGENT_NAME": "gpu-7", "GPUAGENT_IDENTITY_KEY": str(key_path)}
    )
    assert again.fingerprint == fingerprint  # the same identity after a restart


def test_it_trusts_the_control_plane_keys_it_is_given_as_pem_files_or_hex(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    current, next_key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pem = tmp_path / "controlplane.pub.pem"
    pem.write_bytes(
        current.public_key().public_bytes(
            serialization.Encoding.PEM,
            serialization.PublicFormat.SubjectPublicKeyInfo,
        )
    )
    env = {
        "GPUAGENT_NAME": "gpu-7",
        "GPUAGENT_STATE_DIR": str(tmp_path / "state"),
        "GPUAGENT_CONTROLPLANE_KEY": f"{pem},{identity.public_raw(next_key).hex()}",
    }

    me = worker.agent_from_environment(env)

    assert me.controlplane_keys == (
        identity.public_raw(current),
        identity.public_raw(next_key),
    )
    assert me.identity_key_path == tmp_path / "state" / "identity.key"


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


def test_it_uses_the_broker_it_is_given_whatever_the_environment_says(monkeypatch):
    """Celery lets CELERY_BROKER_URL win over the broker a Celery app is made
    with; an agent started with --broker goes where it was told."""
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://elsewhere.invalid:6379/9")
    given = "rediss://agent-gpu-1:s3cret@redis.internal:6380/0"

    app = worker.make_app(given, "gpu-1")

    for connection in (app.connection_for_write(), app.connection_for_read()):
        assert connection.as_uri(include_password=True) == given
