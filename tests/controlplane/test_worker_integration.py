"""A real `celery -A controlplane worker` process runs the pipeline against the
database and broker the test settings point at: PostgreSQL + Redis when
DATABASE_URL/CELERY_BROKER_URL say so (as .ci/run sets), else the embedded defaults
(SQLite file + SQLAlchemy transport). A queue of its own keeps other workers on the
same broker from taking this test's tasks."""

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings

from controlplane import celery_app
from controlplane.accounts.models import ApiToken
from controlplane.celery import worker_command
from controlplane.releases.actions import do_approve_release, do_request_promotion
from controlplane.releases.models import Release

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


@pytest.fixture
def worker(tmp_path):
    queue = f"it-{uuid.uuid4().hex[:10]}"
    default_queue = celery_app.conf.task_default_queue
    # Read at send time by celery's router: this test's tasks go to its own queue.
    celery_app.conf.task_default_queue = queue
    log_path = tmp_path / "worker.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": database_url(),
        "CELERY_BROKER_URL": celery_app.conf.broker_url,
        "CELERY_RESULT_BACKEND": str(celery_app.conf.result_backend),
        "RELEASEGATE_SOURCE_ROOTS": ",".join(
            str(root) for root in settings.RELEASEGATE_SOURCE_ROOTS
        ),
    }
    command = worker_command("--without-heartbeat", f"--queues={queue}")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + WAIT_S
        while b"ready." not in log_path.read_bytes():
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield process, log_path
    finally:
        celery_app.conf.task_default_queue = default_queue
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_job(release: Release, kind: str, worker) -> None:
    """Until a `kind` job of the release has finished."""
    process, log_path = worker
    deadline = time.monotonic() + WAIT_S
    while not release.jobs.filter(kind=kind, finished__isnull=False).exists():
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)


def wait_for_state(release: Release, state: str, worker) -> None:
    process, log_path = worker
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        release.refresh_from_db()
        if release.state == state:
            return
        assert process.poll() is None, log_path.read_text()
        time.sleep(0.2)
    pytest.fail(
        f"{release} still {release.state}, wanted {state}:\n" + log_path.read_text()
    )


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_it_promotes_and_deploys_in_a_real_worker(
    worker, release, owner, teammate, pass_gates
):
    backend = (settings.DATABASES["default"]["ENGINE"], celery_app.conf.broker_url)
    print("worker integration against", backend)

    do_request_promotion(release, owner)  # autocommit: queued right away

    wait_for_state(release, "gated", worker)  # no evidence: the gate pauses
    wait_for_job(release, "gate", worker)
    kinds = list(release.jobs.order_by("id").values_list("kind", flat=True))
    assert kinds == ["verify_source", "compress", "sign", "evaluate", "gate"]
    pass_gates(release)
    do_request_promotion(release, owner)  # evidence in: the gate runs again
    wait_for_state(release, "awaiting_approval", worker)

    do_approve_release(release, teammate)

    wait_for_state(release, "live", worker)
    assert release.deployments.get().state == "live"
    assert b"run_deployment" in worker[1].read_bytes()


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_it_promotes_through_the_api_in_a_real_worker(
    worker, client, make_release, owner, teammate, make_source, pass_gates
):
    # A local source, so verify_source and sign run for real and record a digest.
    source = make_source("m")
    source.rmdir()
    shutil.copytree(ROOT / "gpuagent" / "engine" / "demo_model", source)
    release = make_release(source_uri=source.as_uri())
    _, ci_token = ApiToken.create(owner, release.team, "ci", ["read", "promote"])
    _, approver_token = ApiToken.create(
        teammate, release.team, "approver", ["read", "approve"]
    )

    response = client.post(
        f"/api/v1/releases/{release.pk}/promote",
        headers={"authorization": f"Bearer {ci_token}"},
    )

    assert response.status_code == 202, response.content
    status_url = response.json()["status_url"]
    wait_for_state(release, "gated", worker)
    wait_for_job(release, "gate", worker)
    pass_gates(release)
    again = client.post(
        f"/api/v1/releases/{release.pk}/promote",
        headers={"authorization": f"Bearer {ci_token}"},
    )
    assert again.status_code == 202, again.content
    wait_for_state(release, "awaiting_approval", worker)
    seen = client.get(status_url, headers={"authorization": f"Bearer {ci_token}"})
    assert seen.json()["state"] == "awaiting_approval"
    digest = seen.json()["manifest_digest"]
    assert digest == release.manifest_digest and digest

    approved = client.post(
        f"/api/v1/releases/{release.pk}/approve",
        {"manifest_digest": digest, "comment": "looks good"},
        content_type="application/json",
        headers={"authorization": f"Bearer {approver_token}"},
    )

    assert approved.status_code == 200, approved.content
    wait_for_state(release, "live", worker)
    final = client.get(status_url, headers={"authorization": f"Bearer {ci_token}"})
    assert final.json()["state"] == "live"
    assert [d["state"] for d in final.json()["deployments"]] == ["live"]
