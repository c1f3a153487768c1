"""A real `celery -A controlplane worker` process runs the control plane's tasks
against the database and broker the test settings point at: PostgreSQL + Redis when
DATABASE_URL/CELERY_BROKER_URL say so (as .ci/run sets), else the embedded defaults
(SQLite file + SQLAlchemy transport). A queue of its own keeps other workers on the
same broker from taking this test's tasks."""

import contextlib
import os
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings

from controlplane import celery_app
from controlplane.celery import dies_with_this_process, worker_command
from controlplane.fleet.enrollment import do_enroll_agent
from controlplane.fleet.models import Agent, EnrollmentRequest
from controlplane.releases import stages
from controlplane.releases.actions.promotion import do_request_promotion
from controlplane.releases.models import Job
from gpuagent import tasks
from gpuagent.artifacts import ArtifactStore
from gpuagent.protocol import InspectResult, JobResult
from tests.controlplane.conftest import sealed_beat

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 90


def database_url() -> str:
    """The URL of the database this test runs in (the test database)."""
    db = settings.DATABASES["default"]
    if db["ENGINE"] == "django.db.backends.sqlite3":
        assert str(db["NAME"]) != ":memory:", "a worker cannot open :memory:"
        return f"sqlite:///{db['NAME']}"
    assert db["ENGINE"] == "django.db.backends.postgresql", db["ENGINE"]
    auth = quote(db["USER"] or "")
    if db.get("PASSWORD"):
        auth += ":" + quote(db["PASSWORD"])
    host = db["HOST"] or "127.0.0.1"
    return f"postgres://{auth}@{host}:{db['PORT'] or 5432}/{db['NAME']}"


@contextlib.contextmanager
def celery_worker(log_path: Path, queue: str, *args: str, **env: str):
    """A real control-plane worker consuming `queue` (more worker `args` may
    follow), against the test database and the app's broker and result store
    (`env` overrides), from when it is ready until the block ends: (process, log
    path). It dies with the test process, however that ends."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": database_url(),
        "CELERY_BROKER_URL": celery_app.conf.broker_url,
        "CELERY_RESULT_BACKEND": str(celery_app.conf.result_backend),
        "RELEASEGATE_SOURCE_ROOTS": ",".join(
            str(root) for root in settings.RELEASEGATE_SOURCE_ROOTS
        ),
        "RELEASEGATE_CONTROLPLANE_KEY": str(settings.RELEASEGATE_CONTROLPLANE_KEY),
        **env,
    }
    command = worker_command("--without-heartbeat", f"--queues={queue}", *args)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=dies_with_this_process(),
        )
    try:
        deadline = time.monotonic() + WAIT_S
        while b"ready." not in log_path.read_bytes():
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield process, log_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def worker(tmp_path):
    queue = f"it-{uuid.uuid4().hex[:10]}"
    default_queue = celery_app.conf.task_default_queue
    # Read at send time by celery's router: this test's tasks go to its own queue.
    celery_app.conf.task_default_queue = queue
    try:
        with celery_worker(tmp_path / "worker.log", queue) as started:
            yield started
    finally:
        celery_app.conf.task_default_queue = default_queue


def wait_for(predicate, worker, what: str) -> None:
    process, log_path = worker
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, f"{what}\n" + log_path.read_text()
        time.sleep(0.2)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_it_records_agent_messages_in_a_real_worker(
    worker, make_release, owner, tmp_path
):
    """What an enrolled agent sends (heartbeat, progress, result), sealed with its
    key, goes through the broker to the control plane's tasks in a worker
    process, which move the release on and send the next job to the agents' pool
    queue; a duplicate result is ignored."""
    backend = (settings.DATABASES["default"]["ENGINE"], celery_app.conf.broker_url)
    print("worker integration against", backend)
    release = make_release()
    me = tasks.Agent(
        name="cpu-1",
        store=ArtifactStore(tmp_path / "artifacts"),
        signing_key=None,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
    )
    celery_app.send_task("controlplane.fleet.record_heartbeat", sealed_beat(me))
    wait_for(
        lambda: EnrollmentRequest.objects.filter(fingerprint=me.fingerprint).exists(),
        worker,
        "pending enrollment",
    )
    assert not Agent.objects.filter(name="cpu-1").exists()  # nothing more
    do_enroll_agent(
        EnrollmentRequest.objects.get(fingerprint=me.fingerprint),
        actor="system:tests",
    )
    celery_app.send_task("controlplane.fleet.record_heartbeat", sealed_beat(me))
    wait_for(
        lambda: Agent.objects.filter(name="cpu-1", state="online").exists(),
        worker,
        "beat",
    )
    assert Agent.objects.get(name="cpu-1").gpu_memory_free_bytes == 2**29

    do_request_promotion(release, owner)
    wait_for(lambda: release.jobs.filter(kind="verify_source").exists(), worker, "job")
    job = release.jobs.get(kind="verify_source")
    request = stages.request_for(job)
    celery_app.send_task(
        "controlplane.releases.record_job_progress",
        tasks.sealed_progress(request, 0.5, me),
    )
    wait_for(
        lambda: Job.objects.filter(pk=job.pk, state="running").exists(), worker, "run"
    )
    result = JobResult(
        job_id=job.pk,
        kind="verify_source",
        ok=True,
        agent="cpu-1",
        payload=InspectResult(ok=True).model_dump(mode="json"),
    )
    for _ in range(2):  # the second is a duplicate (sealed anew)
        celery_app.send_task(
            "controlplane.releases.record_job_result",
            tasks.sealed_result(result, request, me),
        )

    wait_for(lambda: release.jobs.filter(kind="compress").exists(), worker, "next")
    worker_log = worker[1]
    wait_for(lambda: b"'ignored'" in worker_log.read_bytes(), worker, "duplicate")
    release.refresh_from_db()
    assert release.state == "compressing"
    assert release.jobs.filter(kind="compress").count() == 1
    assert Job.objects.get(pk=job.pk).agent.name == "cpu-1"
