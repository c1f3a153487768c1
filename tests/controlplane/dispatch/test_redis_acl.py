"""The README's Redis set-up, against a real redis-server over TLS with the ACL
file the README gives: an agent takes jobs from its own queue and its pool's and
answers on the control plane's, and can do nothing else; both sides refuse a
server whose certificate they cannot check."""

import shutil
import socket
import subprocess
import time
from datetime import UTC, datetime, timedelta
from ipaddress import ip_address
from pathlib import Path

import pytest
import redis
from celery import Celery
from kombu import Consumer, Exchange, Queue
from kombu.exceptions import OperationalError

from controlplane.settings import redis_tls_options
from gpuagent import worker

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server"
)
README = Path(__file__).resolve().parents[3] / "README.md"
PASSWORDS = {"CP_PASSWORD": "cp-secret", "AGENT_PASSWORD": "agent-secret"}


def readme_acl() -> list[str]:
    """The `user ...` lines of the README's ACL file, passwords filled in."""
    block = README.read_text().split("An ACL file for")[1].split("```")[1]
    lines = [line for line in block.splitlines() if line.startswith("user ")]
    for name, value in PASSWORDS.items():
        lines = [line.replace(name, value) for line in lines]
    return lines


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 that is its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test redis")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ip_address("127.0.0.1"))]),
            False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = folder / "redis.key", folder / "redis.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture
def redis_tls(tmp_path):
    """redis-server on a free port, TLS only, with the README's users. Yields
    (port, CA file)."""
    key_path, cert_path = self_signed(tmp_path)
    acl = tmp_path / "users.acl"
    acl.write_text("\n".join(readme_acl()) + "\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port)]
        + ["--tls-cert-file", str(cert_path), "--tls-key-file", str(key_path)]
        + ["--tls-ca-cert-file", str(cert_path), "--tls-auth-clients", "no"]
        + ["--aclfile", str(acl), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    for _ in range(200):  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    yield port, cert_path
    server.terminate()
    server.wait(timeout=10)


def url(user: str, password: str, port: int, ca: Path | None) -> str:
    tls = f"?ssl_ca_certs={ca}" if ca else ""
    return f"rediss://{user}:{password}@127.0.0.1:{port}/0{tls}"


def control_plane(broker: str) -> Celery:
    app = Celery("controlplane-test", broker=broker)
    app.conf.broker_use_ssl = redis_tls_options(broker)
    # this server, not a CELERY_BROKER_URL of the environment (which Celery
    # lets win over the constructor's broker)
    app.conf.update(broker_read_url=broker, broker_write_url=broker)
    return app


def queue(name: str) -> Queue:
    return Queue(name, Exchange(name), name)  # as Celery makes one by name


def take(app: Celery, names: list[str], count: int) -> list:
    """`count` messages' first arguments from queues `names`, acknowledged after
    (as a worker with acks_late does: held unacknowledged meanwhile)."""
    got = []

    def on_message(body, message) -> None:
        got.append(body[0][0])
        message.ack()

    with app.connection_for_read() as connection:
        queues = [queue(name) for name in names]
        with Consumer(connection, queues, callbacks=[on_message], accept=["json"]):
            while len(got) < count:
                connection.drain_events(timeout=10)
    return got


def test_an_agent_takes_its_jobs_and_answers_the_control_plane(redis_tls, monkeypatch):
    port, ca = redis_tls
    cp = control_plane(url("releasegate-cp", "cp-secret", port, ca))
    agent = worker.make_app(url("agent-gpu-1", "agent-secret", port, ca), "gpu-1")
    monkeypatch.setattr(
        worker,
        "_agent",
        worker.agent_from_environment(
            {"GPUAGENT_NAME": "gpu-1", "GPUAGENT_ARTIFACTS": str(ca.parent)}
        ),
    )
    cp.send_task("t.job", args=["pool"], queue="agents", ignore_result=True)
    cp.send_task("t.job", args=["own"], queue="agent.gpu-1", ignore_result=True)

    done = take(agent, ["agent.gpu-1", "agents"], 2)
    worker.send_to_controlplane("t.done", *sorted(done), app=agent)

    assert sorted(done) == ["own", "pool"]
    assert take(cp, ["celery"], 1) == ["own"]  # t.done's first argument


def test_an_agent_can_do_nothing_else(redis_tls):
    port, ca = redis_tls
    as_agent = redis.Redis(
        host="127.0.0.1",
        port=port,
        username="agent-gpu-1",
        password="agent-secret",
        ssl=True,
        ssl_ca_certs=ca,
    )
    refused = {
        "read the control plane's queue": lambda: as_agent.lrange("celery", 0, -1),
        "read another agent's queue": lambda: as_agent.llen("agent.gpu-2"),
        "push to another agent's queue": lambda: as_agent.lpush("agent.gpu-2", "x"),
        "read what others hold unacked": lambda: as_agent.hgetall("unacked"),
        "bind the control plane's queue": lambda: as_agent.sadd(
            "_kombu.binding.celery", "x"
        ),
        "run admin commands": lambda: as_agent.config_get("*"),
        "flush": lambda: as_agent.flushdb(),
    }
    for what, call in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
            pytest.fail(f"an agent may {what}")


def test_both_sides_refuse_a_server_they_cannot_check(redis_tls):
    port, _ = redis_tls  # no CA given: the system's do not know this server
    cp = control_plane(url("releasegate-cp", "cp-secret", port, None))
    agent = worker.make_app(url("agent-gpu-1", "agent-secret", port, None), "gpu-1")

    for app in (cp, agent):
        with app.connection_for_write() as connection:
            with pytest.raises(OperationalError, match="CERTIFICATE_VERIFY_FAILED"):
                connection.ensure_connection(max_retries=0)
