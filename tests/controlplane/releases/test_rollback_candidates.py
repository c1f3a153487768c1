"""Which release a rollback goes to, what happens when its copy no longer
verifies on the agent, and the environment policy that rolls back by itself after
a failed re-verification. The agent's answers come through conftest.LocalAgent."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Deployment
from controlplane.releases.actions.deployments import (
    do_complete_deployment,
    do_start_deployment,
)
from controlplane.releases.actions.rollbacks import do_rollback_environment
from controlplane.releases.models import EnvironmentGatePolicy, Release
from controlplane.releases.tasks import run_deployment, run_reverification
from gpuagent.protocol import DeployResult, VerifyResult

CHANGED = "manifest digest mismatch; changed: model.safetensors"


def go_live(release, actor):
    deployment = do_start_deployment(release, actor=actor)
    return do_complete_deployment(deployment, actor=actor, endpoint="http://a:8000")


@pytest.fixture
def three(make_release, owner, queued):
    """1.0.1, then 1.0.2, then 1.0.3 went live (each with its own digest)."""
    releases = []
    for n in (1, 2, 3):
        release = make_release(state="approved", manifest_digest=f"sha256:{n}" * 4)
        go_live(release, owner)
        releases.append(release)
    return releases


def state(release) -> str:
    return Release.objects.get(pk=release.pk).state


def refuse(local_agent, release, *, changed=(), error=CHANGED) -> None:
    """The agent answers the rollback target's deploy job: its files differ
    (`changed`), or it fails otherwise (`error` alone)."""
    assert run_deployment(release.pk) == "deploying"
    code = "manifest-mismatch" if changed else "start-failed"
    result = DeployResult(ok=False, error=error, error_code=code, changed=list(changed))
    local_agent.answer("deploy", result, error=error)


def test_it_tries_the_next_older_release_when_the_target_no_longer_verifies(
    three, environment, teammate, local_agent
):
    first, second, third = three
    do_rollback_environment(environment, teammate)

    refuse(local_agent, second, changed=["model.safetensors"])

    assert state(second) == "quarantined"  # its copy changed: untrusted
    assert state(first) == "deploying"
    following = Deployment.objects.get(release=first, state="deploying")
    assert following.rollback_tried == [f"{second} (changed: model.safetensors)"]
    assert run_deployment(first.pk) == "deploying"
    local_agent.answer("deploy", DeployResult(ok=True, endpoint="http://a:8000"))
    assert state(first) == "live"
    assert environment.live_deployment.release == first
    assert state(third) == "rolled_back"
    event = AuditEvent.objects.get(verb="environment.rollback_continued")
    assert event.after["release_id"] == first.pk


def test_it_ends_with_every_reason_when_no_previous_release_verifies(
    three, environment, teammate, local_agent
):
    first, second, _ = three
    do_rollback_environment(environment, teammate)
    refuse(local_agent, second, changed=["model.safetensors"])

    refuse(local_agent, first, error="not loadable")

    assert (state(second), state(first)) == ("quarantined", "failed")
    assert not Release.objects.filter(state="deploying").exists()  # none stuck
    assert environment.live_deployment is None
    last = Deployment.objects.filter(release=first).order_by("-id").first()
    expected = (
        f"no previous release of {environment.name} still verifies: "
        f"{second} (changed: model.safetensors), {first} (not loadable)"
    )
    assert last.reason == expected
    assert last.ended is not None
    assert (
        AuditEvent.objects.get(verb="environment.rollback_failed").after["reason"]
        == expected
    )
    assert last.to_dict()["reason"] == expected  # the API's deployment body


def test_the_candidates_tried_are_bounded(
    three, environment, teammate, local_agent, settings
):
    settings.RELEASEGATE_ROLLBACK_MAX_CANDIDATES = 1
    first, second, _ = three
    do_rollback_environment(environment, teammate)

    refuse(local_agent, second, changed=["config.json"])

    assert state(first) == "superseded"  # not tried: the bound was reached
    last = Deployment.objects.filter(release=second).order_by("-id").first()
    assert "gave up after 1 candidates" in last.reason
    assert f"{second} (changed: config.json)" in last.reason


def test_it_sends_the_quarantined_digests_with_every_deploy_job(
    three, environment, teammate, local_agent
):
    _, second, third = three
    do_rollback_environment(environment, teammate)
    refuse(local_agent, second, changed=["model.safetensors"])

    run_deployment(three[0].pk)

    (_, request), *_ = local_agent.pending("deploy")
    assert request.quarantined_digests == [second.manifest_digest]
    assert third.manifest_digest not in request.quarantined_digests  # rolled back


def tampered_live_copy(three, local_agent) -> Deployment:
    """The live 1.0.3 fails its periodic re-verification."""
    deployment = Deployment.objects.get(release=three[2], state="live")
    run_reverification(deployment.pk)
    local_agent.answer(
        "reverify",
        VerifyResult(ok=False, manifest_digest="", changed=["config.json"]),
        error="manifest mismatch; changed: config.json",
    )
    return deployment


def auto_rollback(environment, on: bool) -> None:
    EnvironmentGatePolicy.objects.create(
        environment=environment,
        policy={"auto_rollback_on_failed_verification": on},
    )


def test_the_environment_policy_rolls_back_after_a_failed_reverification(
    three, environment, local_agent, queued
):
    auto_rollback(environment, True)
    _, second, third = three

    tampered_live_copy(three, local_agent)

    assert state(third) == "quarantined"
    assert state(second) == "deploying"
    event = AuditEvent.objects.get(verb="environment.rolled_back")
    assert event.actor_name == "system:auto-rollback"
    assert "failed re-verification" in event.after["reason"]
    assert "changed: config.json" in event.after["reason"]
    assert queued("run_deployment")[-1] == (second.pk,)


def test_without_the_policy_it_waits_for_an_operator(three, environment, local_agent):
    _, second, third = three

    tampered_live_copy(three, local_agent)

    assert state(third) == "failed_verification"
    assert state(second) == "superseded"
    assert not AuditEvent.objects.filter(verb="environment.rolled_back").exists()


def test_an_automatic_rollback_with_no_candidate_is_recorded_as_refused(
    make_release, owner, environment, local_agent
):
    auto_rollback(environment, True)
    only = make_release(state="approved", manifest_digest="sha256:" + "a" * 64)
    deployment = go_live(only, owner)
    run_reverification(deployment.pk)

    local_agent.answer(
        "reverify",
        VerifyResult(ok=False, manifest_digest="", changed=["config.json"]),
        error="manifest mismatch; changed: config.json",
    )

    assert state(only) == "failed_verification"
    event = AuditEvent.objects.get(verb="environment.auto_rollback_refused")
    assert "no previous verified release" in event.after["refused"]
