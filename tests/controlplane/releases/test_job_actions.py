from datetime import timedelta

import pytest
from django.db import IntegrityError
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.errors import JobLeaseHeld, ValidationFailed
from controlplane.releases.actions.jobs import (
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


def expire_lease(job: Job, lease_expires=None) -> None:
    """As if the job's worker died: its lease ran out (or, for a row from before
    leases existed, was never set)."""
    Job.objects.filter(pk=job.pk).update(lease_expires=lease_expires)


def test_it_leases_a_new_job_for_the_configured_time(release, settings):
    settings.RELEASEGATE_JOB_LEASE_S = 60
    before = timezone.now()

    job = do_start_job(release, "compress")

    stored = Job.objects.get(pk=job.pk)
    assert stored.state == "running"
    assert before + timedelta(seconds=60) <= stored.lease_expires
    assert stored.lease_expires <= timezone.now() + timedelta(seconds=60)


def test_it_refuses_a_running_job_while_its_lease_is_held(release):
    first = do_start_job(release, "compress")

    with pytest.raises(JobLeaseHeld) as refused:
        do_start_job(release, "compress")

    stored = Job.objects.get(pk=first.pk)
    assert (stored.state, stored.attempts) == ("running", 1)
    assert stored.lease_expires == first.lease_expires
    assert (refused.value.job_id, refused.value.kind) == (first.pk, "compress")
    assert refused.value.lease_expires == first.lease_expires
    assert str(first.pk) in refused.value.message
    assert first.lease_expires.isoformat() in refused.value.message
    assert Job.objects.filter(release=release).count() == 1


def test_it_leases_each_kind_on_its_own(release):
    do_start_job(release, "compress")

    evaluate = do_start_job(release, "evaluate")

    assert evaluate.attempts == 1
    assert Job.objects.filter(release=release, state="running").count() == 2


@pytest.mark.parametrize("expired", [timedelta(seconds=-1), None])
def test_it_resumes_a_job_whose_worker_died(release, expired):
    first = do_start_job(release, "compress")
    expire_lease(first, expired and timezone.now() + expired)

    again = do_start_job(release, "compress")

    assert again.pk == first.pk
    stored = Job.objects.get(pk=first.pk)
    assert stored.attempts == 2
    assert stored.lease_expires > timezone.now()
    with pytest.raises(JobLeaseHeld):  # the resumed job is held by its new worker
        do_start_job(release, "compress")


def test_it_resumes_a_queued_job(release):
    queued = Job.objects.create(release=release, kind="compress")

    job = do_start_job(release, "compress")

    assert job.pk == queued.pk
    stored = Job.objects.get(pk=queued.pk)
    assert (stored.state, stored.attempts) == ("running", 1)
    assert stored.lease_expires > timezone.now()


def test_it_extends_the_lease_on_progress(release, settings):
    job = do_start_job(release, "compress")
    expire_lease(job, timezone.now() - timedelta(seconds=1))  # a slow stage
    settings.RELEASEGATE_JOB_LEASE_S = 3600
    before = timezone.now()

    do_update_job_progress(job, 0.5)

    stored = Job.objects.get(pk=job.pk)
    assert stored.progress == 0.5
    assert stored.lease_expires >= before + timedelta(seconds=3600)
    assert job.lease_expires == stored.lease_expires
    with pytest.raises(JobLeaseHeld):  # the heartbeat kept the job
        do_start_job(release, "compress")


def test_it_does_not_lease_a_finished_job_on_progress(release):
    job = do_finish_job(do_start_job(release, "compress"), error="oom")

    do_update_job_progress(job, 0.5)

    stored = Job.objects.get(pk=job.pk)
    assert (stored.state, stored.progress) == ("failed", 0.5)
    assert stored.lease_expires is None


@pytest.mark.parametrize("error", ["", "oom"])
def test_it_clears_the_lease_on_finish(release, error):
    job = do_start_job(release, "compress")

    do_finish_job(job, error=error)

    assert Job.objects.get(pk=job.pk).lease_expires is None
    assert Job.objects.get(pk=job.pk).to_dict()["lease_expires"] is None
    assert do_start_job(release, "compress").pk != job.pk


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
