"""The shared cast for every control-plane test (dashboard and API alike):

- `team` ("Acme ML") with `owner` (admin) and `teammate` (approver);
- `outsider`, a member of `other_team`, who must see nothing of `team`;
- `environment` (team's "staging"), `model_family`, `release` (registered by owner);
- `source_roots`: the host's source root for the test (each team's folder is
  <root>/<slug>); `make_source(name, files)` makes a model folder in the team's;
- factories `make_environment`, `make_model_family`, `make_release` for more;
- `expire_lease(job)`: the job's worker "died" a second ago;
- `pass_gates(release)`: what the pipeline's gate stage will record once it has
  the evidence: integrity passed, under a policy of the target environment that
  gates nothing else (the quality and load jobs are not built yet);
- `queued(task)`: the args of each task the code under test queued (outbox rows);
- `broker_at(url)` points Celery at a real broker for one test (with the timeouts
  settings.py gives that kind of URL): `working_broker` (the embedded SQLAlchemy
  transport in a file of the test's own), `unreachable_broker_url` (Redis on a port
  nothing listens on); `result_store_at(url)` does the same for the result backend;
- `redis_server`: a real Redis of the test's own, which the test may stop and start.

Every user's password is PASSWORD.
"""

import contextlib
import itertools
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
from celery.app.backends import by_url
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.utils import timezone

from controlplane import celery_app
from controlplane.accounts.models import Membership, Team
from controlplane.dispatch.models import OutboxMessage
from controlplane.fleet.models import Environment
from controlplane.releases.actions.gate_policies import do_set_gate_policy
from controlplane.releases.actions.gate_results import do_evaluate_release_gates
from controlplane.releases.actions.registration import do_register_release
from controlplane.releases.models import Job, ModelFamily, Release
from controlplane.settings import broker_transport_options

PASSWORD = "correct-horse-battery"
RECIPE = {"weights": "int4-g128", "kv_cache_dtype": "int8"}


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _user(username: str) -> User:
    return User.objects.create_user(
        username, email=f"{username}@example.org", password=PASSWORD
    )


@pytest.fixture
def team(db) -> Team:
    return Team.objects.create(name="Acme ML", slug="acme")


@pytest.fixture
def other_team(db) -> Team:
    return Team.objects.create(name="Other Co", slug="other")


@pytest.fixture
def owner(team) -> User:
    user = _user("alice")
    Membership.objects.create(team=team, user=user, role="admin")
    return user


@pytest.fixture
def teammate(team) -> User:
    user = _user("bob")
    Membership.objects.create(team=team, user=user, role="approver")
    return user


@pytest.fixture
def member(team) -> User:
    """A plain member of `team`: may register and promote, not approve."""
    user = _user("carol")
    Membership.objects.create(team=team, user=user, role="member")
    return user


@pytest.fixture
def operator(db) -> User:
    """A platform operator: Django staff, in no team."""
    user = _user("olga")
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    return user


@pytest.fixture
def outsider(other_team) -> User:
    user = _user("mallory")
    Membership.objects.create(team=other_team, user=user, role="admin")
    return user


@pytest.fixture
def make_environment(team):
    def make(name: str = "staging", *, of_team: Team | None = None) -> Environment:
        return Environment.objects.create(team=of_team or team, name=name)

    return make


@pytest.fixture
def environment(make_environment) -> Environment:
    return make_environment("staging")


@pytest.fixture
def make_model_family(team):
    def make(name: str = "llama-support", *, of_team: Team | None = None):
        return ModelFamily.objects.create(
            team=of_team or team, name=name, description=f"{name} family"
        )

    return make


@pytest.fixture
def model_family(make_model_family) -> ModelFamily:
    return make_model_family("llama-support")


@pytest.fixture(autouse=True)
def source_roots(settings, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    settings.RELEASEGATE_SOURCE_ROOTS = [root]
    return root


def team_source_uri(name: str, team: str = "acme") -> str:
    """The URI of `team`'s folder `name` under the test's source root (make it with
    `make_source`)."""
    root = Path(django_settings.RELEASEGATE_SOURCE_ROOTS[0])
    return (root / team / name).as_uri()


@pytest.fixture
def make_source(source_roots):
    def make(name: str, files: dict[str, str] | None = None, *, team="acme") -> Path:
        folder = source_roots / team / name
        folder.mkdir(parents=True, exist_ok=True)
        for file_name, text in (files or {}).items():
            (folder / file_name).write_text(text)
        return folder

    return make


@pytest.fixture
def make_release(model_family, environment, owner, make_source):
    """make_release(version=None, state=None, **fields): registered through the action
    by `owner` from an empty folder of its own (unless `source_uri` says otherwise);
    `state` then forces the row into any state (test setup only)."""
    versions = itertools.count(1)

    def make(
        version: str | None = None,
        *,
        state: str | None = None,
        family: ModelFamily | None = None,
        target_environment: Environment | None = None,
        source_uri: str | None = None,
        recipe: dict | None = None,
        actor=None,
        **fields,
    ) -> Release:
        family = family or model_family
        version = version or f"1.0.{next(versions)}"
        if source_uri is None:
            folder = make_source(f"{family.name}/{version}", team=family.team.slug)
            source_uri = folder.as_uri()
        release, _ = do_register_release(
            family,
            version=version,
            source_uri=source_uri,
            recipe=recipe or RECIPE,
            target_environment=target_environment or environment,
            actor=actor or owner,
        )
        if state is not None:
            fields["state"] = state
        if fields:
            Release.objects.filter(pk=release.pk).update(**fields)
            release.refresh_from_db()
        return release

    return make


@pytest.fixture
def release(make_release) -> Release:
    return make_release("1.0.0")


@pytest.fixture
def expire_lease():
    """expire_lease(job): let the job's lease run out, as when its worker dies."""

    def expire(job: Job) -> None:
        Job.objects.filter(pk=job.pk).update(
            lease_expires=timezone.now() - timedelta(seconds=1)
        )

    return expire


@pytest.fixture
def pass_gates(owner):
    def record(release: Release) -> None:
        do_set_gate_policy(
            release.target_environment, {"quality": None, "load": None}, actor=owner
        )
        decision = do_evaluate_release_gates(
            release, quality=None, load=None, integrity_ok=True
        )
        assert decision.ok, decision

    return record


@pytest.fixture
def queued(settings):
    """queued("run_deployment") -> [args, ...]: what the code under test queued for
    that task (by the last part of its name) through the outbox, oldest first.
    Nothing is published on commit meanwhile, so every message stays there to be
    read; the dispatch tests publish to a real broker."""
    settings.RELEASEGATE_OUTBOX_PUBLISH_ON_COMMIT = False

    def read(task: str) -> list[tuple]:
        messages = OutboxMessage.objects.filter(task__endswith=f".{task}")
        return [tuple(m.args) for m in messages.order_by("id")]

    return read


@pytest.fixture
def broker_at():
    # Read and write URLs too: celery prefers a CELERY_BROKER_URL environment
    # variable (set for the Redis runs) over conf.broker_url.
    keys = ("broker_url", "broker_read_url", "broker_write_url")
    saved = {key: celery_app.conf.get(key) for key in keys}
    saved_options = celery_app.conf.broker_transport_options

    def point(url: str) -> None:
        for key in keys:
            celery_app.conf[key] = url
        celery_app.conf.broker_transport_options = broker_transport_options(
            url,
            connect_timeout_s=django_settings.BROKER_CONNECT_TIMEOUT_S,
            socket_timeout_s=django_settings.CELERY_REDIS_SOCKET_TIMEOUT,
        )

    yield point
    for key, value in saved.items():
        celery_app.conf[key] = value
    celery_app.conf.broker_transport_options = saved_options


@pytest.fixture
def result_store_at(monkeypatch):
    """result_store_at(url): the app's result backend is `url` for one test. (A
    CELERY_RESULT_BACKEND variable wins over conf.result_backend, and the backend
    object is cached per thread: this thread's is replaced.)"""

    def point(url: str) -> None:
        backend_cls, url = by_url(url, celery_app.loader)
        monkeypatch.setattr(celery_app, "_backend_cache", None)
        backend = backend_cls(app=celery_app, url=url)
        monkeypatch.setattr(celery_app._local, "backend", backend, raising=False)

    return point


@pytest.fixture
def working_broker(broker_at, tmp_path) -> str:
    url = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
    broker_at(url)
    return url


@pytest.fixture
def unreachable_broker_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"redis://127.0.0.1:{port}/12"  # closed again: connections are refused


def sealed_beat(agent, /, **fields) -> tuple[dict, dict]:
    """(heartbeat, seal) of the gpuagent.worker.Agent `agent`, as its worker sends
    them (record_heartbeat's arguments); `fields` replace what the beat says."""
    from gpuagent.integrity import identity
    from gpuagent.integrity.keys import public_key_pem
    from gpuagent.protocol import Heartbeat

    said = {
        "agent": agent.name,
        "queue": agent.queue,
        "pool_queue": agent.pool_queue,
        "incarnation": agent.incarnation,
        "started": agent.started,
        "device": "cpu",
        "gpu_model": "CPU test",
        "memory_total_bytes": 2**30,
        "memory_free_bytes": 2**29,
        "can_sign": agent.signing_key is not None,
        "public_key": identity.public_raw(agent.identity).hex(),
        "signing_public_key": (
            public_key_pem(agent.signing_key).decode() if agent.signing_key else ""
        ),
    }
    body = Heartbeat(**{**said, **fields}).model_dump(mode="json")
    sealed = identity.seal(agent.identity, body, type="heartbeat")
    return body, sealed.model_dump(mode="json")


def enroll(agent, *, can_sign: bool = False, reported_devices=(), **fields):
    """Enroll the gpuagent.worker.Agent `agent` as an operator would: its first
    sealed beat files a pending request (reporting `reported_devices`, DeviceInfo
    dicts), the operator approves it (name, pool and may-sign as given), its next
    beat finds it enrolled and online."""
    from controlplane.fleet.enrollment import do_enroll_agent
    from controlplane.fleet.models import Agent, EnrollmentRequest
    from controlplane.fleet.tasks import record_heartbeat

    first = sealed_beat(agent, devices=list(reported_devices))
    assert record_heartbeat(*first) == "pending"
    request = EnrollmentRequest.objects.get(fingerprint=agent.fingerprint)
    do_enroll_agent(
        request,
        actor="system:tests",
        name=fields.pop("name", agent.name),
        pool_queue=agent.pool_queue,
        can_sign=can_sign,
        **fields,
    )
    assert record_heartbeat(*sealed_beat(agent)) == "online"
    return Agent.objects.get(fingerprint=agent.fingerprint)


@pytest.fixture(autouse=True)
def controlplane_key(settings, tmp_path_factory) -> bytes:
    """The control plane's job-request key: one per test session, never var/'s.
    Returns its raw public key (what agents are given)."""
    from controlplane.fleet.keys import controlplane_key
    from gpuagent.integrity import identity

    settings.RELEASEGATE_CONTROLPLANE_KEY = (
        tmp_path_factory.getbasetemp() / "controlplane-key" / "controlplane.key"
    )
    return identity.public_raw(controlplane_key())


class LocalAgent:
    """Two enrolled agents in the test process sharing one artifact store: "local"
    (signs; does every job but verify) and "checker" (verifies: never the
    signer). It takes the gpuagent.run_job messages the code under test queued
    (outbox rows), checks their seals as the agent's task does, runs them through
    gpuagent.tasks.execute, the task's own code, then hands the sealed JobResult
    to the record_job_result task. `answer(kind, ...)` instead records a result
    as an agent would send it (for the evaluate and load-test jobs, whose real
    runs the process tests do)."""

    def __init__(self, tmp_path: Path, controlplane_key: bytes, devices=()):
        from gpuagent import tasks
        from gpuagent.artifacts import ArtifactStore
        from gpuagent.integrity.keys import ensure_key_pair

        key = tmp_path / "keys" / "local.pem"
        public = ensure_key_pair(key)
        store = ArtifactStore(tmp_path / "artifacts")
        self.tasks = tasks
        common = {
            "store": store,
            "controlplane_queue": "celery",
            "pool_queue": "agents",
            "threads": 1,
            "controlplane_keys": (controlplane_key,),
        }
        self.agent = tasks.Agent(
            name="local", signing_key=key, trusted_keys=(), **common
        )
        self.checker = tasks.Agent(
            name="checker", signing_key=None, trusted_keys=(public,), **common
        )
        # `devices`: what "local" reports when it asks to be enrolled (DeviceInfo
        # dicts), every one of them enrolled.
        self.row = enroll(self.agent, can_sign=True, reported_devices=devices)
        self.checker_row = enroll(self.checker)
        self.taken: set[int] = set()

    def agent_for(self, kind: str):
        return self.checker if kind == "verify" else self.agent

    def beat(self, incarnation: str, *, running_jobs=()) -> tuple[dict, dict]:
        """The sealed beat of "local" as `incarnation` (record_heartbeat's args)."""
        return sealed_beat(
            self.agent,
            incarnation=incarnation,
            started=timezone.now(),
            running_jobs=list(running_jobs),
        )

    def pending(self, kind: str | None = None):
        from gpuagent.protocol import JobRequest

        messages = OutboxMessage.objects.filter(task="gpuagent.run_job").order_by("id")
        found = []
        for message in messages.exclude(pk__in=self.taken):
            request = JobRequest.model_validate(message.args[0])
            if kind is None or request.kind == kind:
                found.append((message, request))
        return found

    def record(self, message, request, result, me=None) -> str:
        from controlplane.releases.tasks import record_job_result

        self.taken.add(message.pk)
        me = me or self.agent_for(request.kind)
        return record_job_result(*self.tasks.sealed_result(result, request, me))

    def work(self, kinds=("verify_source", "compress", "sign", "verify", "deploy")):
        """Run queued jobs of `kinds` until none is left; returns their results."""
        results = []
        while batch := [p for p in self.pending() if p[1].kind in kinds]:
            for message, request in batch:
                me = self.agent_for(request.kind)
                accepted = self.tasks.accept_job(message.args[0], message.args[1], me)
                result = self.tasks.execute(accepted, me, timezone.now())
                results.append(result)
                self.record(message, accepted, result, me)
        return results

    def answer(self, kind: str, payload=None, *, error: str = "") -> str:
        from gpuagent.protocol import JobResult

        (message, request), *_ = self.pending(kind)
        me = self.agent_for(kind)
        result = JobResult(
            job_id=request.job_id,
            kind=kind,
            ok=not error,
            agent=me.name,
            started=timezone.now(),
            finished=timezone.now(),
            error=error,
            payload=payload.model_dump(mode="json") if payload is not None else {},
        )
        return self.record(message, request, result, me)


@pytest.fixture
def local_agent(db, tmp_path, queued, monkeypatch, controlplane_key) -> LocalAgent:
    from gpuagent import tasks

    local = LocalAgent(tmp_path, controlplane_key)

    # Progress goes to the control plane's task directly, not through a broker.
    def progress(request, fraction):
        from controlplane.releases.tasks import record_job_progress

        me = local.agent_for(request.kind)
        record_job_progress(*tasks.sealed_progress(request, fraction, me))

    monkeypatch.setattr(tasks, "report_progress", progress)
    return local


class RedisServer:
    """A redis-server of the test's own on a free port, stopped and started again
    at will (on the same port, with nothing kept across)."""

    def __init__(self, tmp_path: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.tmp = tmp_path
        self.process: subprocess.Popen | None = None

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
            + ["--save", "", "--appendonly", "no", "--dir", str(self.tmp)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
            assert self.process.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "redis-server did not answer"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def redis_server(tmp_path):
    """A running RedisServer; stopped after the test."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
