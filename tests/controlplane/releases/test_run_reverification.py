import pytest

from controlplane.fleet.models import Deployment
from controlplane.releases import stages, tasks
from controlplane.releases.actions import do_approve_release, do_start_job
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import (
    reverify_live_deployments,
    run_deployment,
    run_promotion,
    run_reverification,
)


@pytest.fixture
def live(make_release, teammate, make_source, queued, pass_gates):
    folder = make_source(
        "model",
        {"config.json": '{"model_type": "llama"}', "tokenizer_config.json": "{}"},
    )
    release = make_release(source_uri=folder.as_uri())
    run_promotion(release.pk)
    pass_gates(release)
    run_promotion(release.pk)
    do_approve_release(release, teammate)
    run_deployment(release.pk)
    return folder, release, Deployment.objects.get(release=release)


def test_it_keeps_an_intact_deployment_live(live):
    _, release, deployment = live

    assert run_reverification(deployment.pk) == "live"

    job = Job.objects.get(release=release, kind="reverify")
    assert job.state == "succeeded"
    assert job.result["manifest_digest"] == release.manifest_digest


def test_it_marks_a_tampered_deployment_and_names_the_files(live):
    folder, release, deployment = live
    (folder / "config.json").write_text('{"model_type": "evil"}')
    (folder / "tokenizer_config.json").unlink()
    (folder / "extra.json").write_text("{}")

    assert run_reverification(deployment.pk) == "failed_verification"

    stored = Release.objects.get(pk=release.pk)
    assert stored.state == "failed_verification"
    assert "changed: config.json" in stored.failure_reason
    assert "missing: tokenizer_config.json" in stored.failure_reason
    assert "extra: extra.json" in stored.failure_reason
    job = Job.objects.get(release=release, kind="reverify")
    assert job.result["changed"] == ["config.json"]


def test_it_leaves_deployments_that_are_not_live_alone(live):
    _, release, deployment = live
    Deployment.objects.filter(pk=deployment.pk).update(state="superseded")

    assert run_reverification(deployment.pk) == "superseded"

    assert not Job.objects.filter(release=release, kind="reverify").exists()


def test_it_queues_one_reverification_per_live_deployment(live, monkeypatch):
    _, _, deployment = live
    queued = []
    monkeypatch.setattr(tasks.run_reverification, "delay", lambda *a: queued.append(a))

    assert reverify_live_deployments() == 1

    assert queued == [(deployment.pk,)]


def test_it_leaves_a_rehash_to_the_worker_holding_it_until_its_lease_expires(
    live, monkeypatch, expire_lease
):
    _, release, deployment = live
    job = do_start_job(release, "reverify")  # the previous beat's re-hash
    rehashes = []
    real_reverify = stages.reverify

    def counted_reverify(release):
        rehashes.append(release.pk)
        return real_reverify(release)

    monkeypatch.setattr(stages, "reverify", counted_reverify)

    assert run_reverification(deployment.pk) == tasks.BUSY

    assert rehashes == []
    assert Job.objects.get(pk=job.pk).attempts == 1

    expire_lease(job)  # its worker died

    assert run_reverification(deployment.pk) == "live"

    assert rehashes == [release.pk]
    resumed = Job.objects.get(pk=job.pk)
    assert (resumed.state, resumed.attempts) == ("succeeded", 2)


def test_it_closes_its_job_when_the_rehash_crashes(live, monkeypatch):
    _, release, deployment = live

    def crash(release):
        raise OSError("disk went away")

    monkeypatch.setattr(stages, "reverify", crash)

    assert run_reverification(deployment.pk) == "live"

    job = Job.objects.filter(release=release, kind="reverify").get()
    assert (job.state, job.lease_expires) == ("failed", None)
    assert "OSError: disk went away" in job.error
