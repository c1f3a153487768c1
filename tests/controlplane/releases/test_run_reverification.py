import pytest

from controlplane.fleet.models import Deployment
from controlplane.releases import tasks
from controlplane.releases.actions import do_approve_release
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import (
    reverify_live_deployments,
    run_deployment,
    run_promotion,
    run_reverification,
)


@pytest.fixture
def live(make_release, teammate, tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer_config.json").write_text("{}")
    release = make_release(source_uri=folder.as_uri())
    run_promotion(release.pk)
    monkeypatch.setattr(tasks.run_deployment, "delay", lambda *a: None)
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
