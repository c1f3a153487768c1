import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from django.conf import settings

from controlplane import celery_app
from gpuagent.serving.process import start_time
from tests.controlplane.test_worker_integration import celery_worker


def test_it_reads_its_config_from_django_settings():
    assert celery_app.conf.broker_url == settings.CELERY_BROKER_URL
    assert celery_app.conf.result_backend == settings.CELERY_RESULT_BACKEND
    assert celery_app.conf.task_serializer == "json"
    assert celery_app.conf.task_acks_late is True


def test_it_discovers_the_pipeline_tasks():
    celery_app.loader.import_default_modules()

    assert "controlplane.releases.run_promotion" in celery_app.tasks
    assert "controlplane.releases.run_deployment" in celery_app.tasks
    assert "controlplane.releases.run_reverification" in celery_app.tasks


def test_it_schedules_periodic_reverification_of_a_registered_task():
    celery_app.loader.import_default_modules()

    for entry in celery_app.conf.beat_schedule.values():
        assert entry["task"] in celery_app.tasks
        assert entry["schedule"] > 0


def test_it_does_not_run_tasks_eagerly_by_default():
    # The pipeline must go through a real worker; eager mode would hide that.
    assert celery_app.conf.task_always_eager is False


def test_it_stores_no_result_it_never_reads():
    celery_app.loader.import_default_modules()

    assert celery_app.conf.task_ignore_result is True
    assert celery_app.tasks["controlplane.releases.run_promotion"].ignore_result


def test_a_send_that_asks_for_its_result_gives_up_on_a_store_that_is_down_at_once(
    working_broker, result_store_at, unreachable_broker_url
):
    result_store_at(unreachable_broker_url)  # Redis on a closed port
    started = time.monotonic()

    with pytest.raises(RuntimeError, match="result store"):
        celery_app.send_task(
            "controlplane.releases.run_promotion",
            args=[0],
            queue=f"never-{time.monotonic_ns()}",
            ignore_result=False,  # as an operator's shell may
        )

    assert time.monotonic() - started < 2  # not 20 tries 1 s apart


def children_of(pid: int) -> set[int]:
    """The pids of the live processes whose parent is `pid`."""
    children = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] not in ("Z", "X") and int(fields[1]) == pid:
                children.add(int(entry.name))
    return children


def wait_until_gone(pid: int, started: int | None, timeout_s: float) -> bool:
    """Whether the process (`pid`, start time `started`) ended within `timeout_s`
    (a zombie counts as ended: it runs nothing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if start_time(pid) != started:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_takes_its_embedded_beat_with_it(tmp_path):
    queue = f"beat-{uuid.uuid4().hex[:8]}"
    schedule = f"--schedule={tmp_path / 'beat-schedule'}"
    with celery_worker(tmp_path / "worker.log", queue, "--beat", schedule) as (
        worker,
        log_path,
    ):
        (beat,) = children_of(worker.pid)  # the solo pool: beat is its one child
        beat_started = start_time(beat)
        try:
            worker.kill()  # SIGKILL: nothing of the worker's own runs
            worker.wait()

            assert wait_until_gone(beat, beat_started, 5), log_path.read_text()
        finally:
            if start_time(beat) == beat_started:  # left behind: stop it here
                os.kill(beat, signal.SIGKILL)
