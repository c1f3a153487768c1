import pytest
from django.db import IntegrityError

from controlplane.audit.models import AuditEvent
from controlplane.errors import ValidationFailed
from controlplane.releases.actions import (
    do_finish_job,
    do_start_job,
    do_update_job_progress,
)
from controlplane.releases.models import Job


def test_it_records_a_stage_with_timings(release):
    job = do_start_job(release, "compress")
    do_update_job_progress(job, 0.5)

    do_finish_job(job, result={"bytes": 10})

    stored = Job.objects.get(pk=job.pk)
    assert stored.state == "succeeded"
    assert stored.progress == 1.0
    assert stored.attempts == 1
    assert stored.finished >= stored.started
    assert stored.duration_s >= 0
    assert stored.result == {"bytes": 10}
    assert AuditEvent.objects.get(verb="job.succeeded").after["kind"] == "compress"


def test_it_records_a_failure_with_its_error(release):
    job = do_start_job(release, "verify")

    do_finish_job(job, error="digest mismatch on model.safetensors")

    stored = Job.objects.get(pk=job.pk)
    assert stored.state == "failed"
    assert stored.error == "digest mismatch on model.safetensors"


def test_it_resumes_a_job_whose_worker_died(release):
    first = do_start_job(release, "compress")

    again = do_start_job(release, "compress")

    assert again.pk == first.pk
    assert Job.objects.get(pk=first.pk).attempts == 2


def test_it_starts_a_new_job_after_a_finished_one(release):
    do_finish_job(do_start_job(release, "compress"), error="oom")

    second = do_start_job(release, "compress")

    assert Job.objects.filter(release=release, kind="compress").count() == 2
    assert second.attempts == 1


def test_it_refuses_unknown_kinds(release):
    with pytest.raises(ValidationFailed):
        do_start_job(release, "mine_bitcoin")


@pytest.mark.parametrize("progress", [-0.1, 1.5])
def test_it_refuses_progress_outside_zero_one(release, progress):
    job = do_start_job(release, "evaluate")

    with pytest.raises(ValidationFailed):
        do_update_job_progress(job, progress)


def test_it_has_a_database_constraint_on_progress(release):
    with pytest.raises(IntegrityError):
        Job.objects.create(release=release, kind="evaluate", progress=2.0)
