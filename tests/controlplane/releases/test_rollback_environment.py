import pytest

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict, Forbidden
from controlplane.releases import tasks
from controlplane.releases.actions.deployments import (
    do_complete_deployment,
    do_fail_deployment,
    do_start_deployment,
)
from controlplane.releases.actions.rollbacks import (
    check_rollback_environment,
    do_rollback_environment,
)
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Release
from gpuagent.protocol import DeployResult


def go_live(release, actor):
    deployment = do_start_deployment(release, actor=actor)
    return do_complete_deployment(deployment, actor=actor, endpoint="http://a:8000")


@pytest.fixture
def history(make_release, owner):
    """1.0.1 went live, then 1.0.2 replaced it."""
    old = make_release(state="approved")
    old_deployment = go_live(old, owner)
    new = make_release(state="approved")
    new_deployment = go_live(new, owner)
    return old, old_deployment, new, new_deployment


@pytest.fixture
def deploys(queued):
    return lambda: queued("run_deployment")


def test_it_rolls_back_after_failed_verification_and_quarantines(
    history, environment, teammate, owner, deploys
):
    old, old_deployment, new, new_deployment = history
    do_fail_deployment(
        new_deployment,
        actor=owner,
        reason="model.safetensors changed",
        verification=True,
    )

    deployment = do_rollback_environment(environment, teammate)

    assert Release.objects.get(pk=new.pk).state == "quarantined"
    assert Release.objects.get(pk=old.pk).state == "deploying"
    assert deployment.release == old
    assert deployment.endpoint == "http://a:8000"
    new_deployment.refresh_from_db()
    assert new_deployment.state == "rolled_back"
    assert new_deployment.ended is not None
    assert deploys() == [(old.pk,)]
    event = AuditEvent.objects.get(verb="environment.rolled_back")
    assert event.before["release_id"] == new.pk
    assert event.after["release_id"] == old.pk


def rolled_forward(release, local_agent) -> str:
    """The deployment task sends the rollback's deploy job; the agent answers."""
    assert tasks.run_deployment(release.pk) == "deploying"
    local_agent.answer("deploy", DeployResult(ok=True, endpoint="http://a:8000"))
    return Release.objects.get(pk=release.pk).state


def test_it_finishes_the_rollback_in_the_deployment_task(
    history, environment, teammate, deploys, local_agent
):
    old, _, new, _ = history
    do_rollback_environment(environment, teammate)

    assert rolled_forward(old, local_agent) == "live"
    assert Release.objects.get(pk=new.pk).state == "rolled_back"
    assert environment.live_deployment.release == old


def test_it_keeps_the_verification_failure_when_it_quarantines(
    history, environment, owner, teammate, deploys
):
    _, _, new, new_deployment = history
    reason = "manifest digest mismatch; changed: model.safetensors; extra: evil.py"
    do_fail_deployment(new_deployment, actor=owner, reason=reason, verification=True)

    do_rollback_environment(environment, teammate)

    quarantined = Release.objects.get(pk=new.pk)
    assert quarantined.state == "quarantined"
    assert "rolled back in staging" in quarantined.failure_reason
    assert reason in quarantined.failure_reason


def test_it_never_reports_a_replaced_tampered_release_as_live_again(
    history, make_release, environment, owner, teammate, deploys, local_agent
):
    """1.0.2 fails verification, 1.0.3 replaces it, 1.0.3 is rolled back to 1.0.1:
    1.0.2 stays out of the picture throughout."""
    old, _, tampered, tampered_deployment = history
    do_fail_deployment(
        tampered_deployment, actor=owner, reason="changed: x", verification=True
    )
    replacement = make_release(state="approved")
    go_live(replacement, owner)
    assert environment.live_deployment.release == replacement
    tampered_deployment.refresh_from_db()
    assert tampered_deployment.state == "failed_verification"
    assert tampered_deployment.ended is not None

    do_rollback_environment(environment, teammate)

    assert environment.live_deployment is None  # 1.0.1 is deploying
    assert rolled_forward(old, local_agent) == "live"
    assert environment.live_deployment.release == old
    assert Release.objects.get(pk=tampered.pk).state == "failed_verification"


def test_it_refuses_without_a_previous_verified_release(
    make_release, environment, owner, teammate
):
    go_live(make_release(state="approved"), owner)

    with pytest.raises(Conflict):
        do_rollback_environment(environment, teammate)


def test_it_skips_a_quarantined_previous_release(history, environment, owner, teammate):
    old, _, _, _ = history
    Release.objects.filter(pk=old.pk).update(state="quarantined")

    with pytest.raises(Conflict):
        do_rollback_environment(environment, teammate)


def test_it_refuses_when_nothing_is_live(environment, teammate):
    with pytest.raises(Conflict):
        do_rollback_environment(environment, teammate)


def test_it_refuses_plain_members_and_outsiders(history, environment, member, outsider):
    for actor in (member, outsider):
        with pytest.raises(Forbidden):
            do_rollback_environment(environment, actor)


def test_it_requires_the_promote_scope(history, environment, teammate, team):
    token, _ = ApiToken.create(teammate, team, "ops", ["read", "approve"])

    with pytest.raises(Forbidden):
        do_rollback_environment(environment, token)


def test_it_refuses_a_target_that_changed_after_the_check(
    make_release, history, environment, owner, teammate, deploys
):
    old, _, new, _ = history
    newest = make_release(state="approved")
    go_live(newest, owner)
    target = check_rollback_environment(environment, teammate)
    assert target.release == new
    do_transition_release(new, "quarantined", actor=owner, reason="copy changed")

    with pytest.raises(Conflict) as refused:
        do_rollback_environment(
            environment, teammate, expected_target_release_id=target.release_id
        )

    assert refused.value.field == "target_release_id"
    assert Release.objects.get(pk=newest.pk).state == "live"
    assert Release.objects.get(pk=old.pk).state == "superseded"
    assert deploys() == []
