from controlplane.fleet.models import Deployment
from controlplane.releases import stages, tasks
from controlplane.releases.actions import (
    do_request_promotion,
    do_start_deployment,
    do_start_job,
)
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import run_deployment


def test_it_deploys_an_approved_release(make_release, environment):
    release = make_release(state="approved")

    assert run_deployment(release.pk) == "live"

    deployment = Deployment.objects.get(release=release)
    assert deployment.state == "live"
    assert deployment.environment == environment
    job = Job.objects.get(release=release, kind="deploy")
    assert job.state == "succeeded"
    assert job.finished >= job.started


def test_it_supersedes_the_release_live_before(make_release):
    first = make_release(state="approved")
    run_deployment(first.pk)
    second = make_release(state="approved")

    run_deployment(second.pk)

    assert Release.objects.get(pk=first.pk).state == "superseded"
    assert Deployment.objects.get(release=first).state == "superseded"
    assert Release.objects.get(pk=second.pk).state == "live"


def test_it_is_idempotent(make_release):
    release = make_release(state="approved")
    run_deployment(release.pk)

    assert run_deployment(release.pk) == "live"

    assert Deployment.objects.filter(release=release).count() == 1
    assert Job.objects.filter(release=release, kind="deploy").count() == 1


def test_it_leaves_unapproved_releases_alone(make_release):
    release = make_release(state="awaiting_approval")

    assert run_deployment(release.pk) == "awaiting_approval"

    assert not Deployment.objects.exists()


def test_it_fails_a_crashed_deploy_so_it_can_be_retried(
    make_release, owner, monkeypatch
):
    release = make_release(state="approved")

    def unreachable_agent(release, deployment):
        raise ConnectionError("agent gpu-1 unreachable")

    monkeypatch.setattr(stages, "deploy", unreachable_agent)

    assert run_deployment(release.pk) == "failed"

    release.refresh_from_db()
    assert release.failure_reason == "ConnectionError: agent gpu-1 unreachable"
    assert Deployment.objects.get(release=release).state == "failed"
    job = Job.objects.get(release=release, kind="deploy")
    assert (job.state, job.error) == ("failed", release.failure_reason)
    # Not stranded: a promote moves it back into the pipeline.
    assert do_request_promotion(release, owner).state == "registered"


def test_it_leaves_a_deploy_to_the_worker_holding_it_until_its_lease_expires(
    make_release, monkeypatch, expire_lease
):
    release = make_release(state="approved")
    deployment = do_start_deployment(release, actor="system:worker")
    job = do_start_job(release, "deploy")  # another worker is deploying
    deploys = []
    real_deploy = stages.deploy

    def counted_deploy(release, deployment):
        deploys.append(deployment.pk)
        return real_deploy(release, deployment)

    monkeypatch.setattr(stages, "deploy", counted_deploy)

    assert run_deployment(release.pk) == tasks.BUSY

    assert deploys == []
    assert Release.objects.get(pk=release.pk).state == "deploying"
    assert Deployment.objects.get(pk=deployment.pk).state == "deploying"
    assert Job.objects.get(pk=job.pk).attempts == 1

    expire_lease(job)  # its worker died

    assert run_deployment(release.pk) == "live"

    assert deploys == [deployment.pk]
    resumed = Job.objects.get(pk=job.pk)
    assert (resumed.state, resumed.attempts) == ("succeeded", 2)
    assert Deployment.objects.get(release=release).state == "live"
