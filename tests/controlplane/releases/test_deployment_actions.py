import pytest

from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict, IllegalTransition
from controlplane.releases.actions.deployments import (
    do_complete_deployment,
    do_fail_deployment,
    do_start_deployment,
)
from controlplane.releases.models import Release


def test_it_starts_a_deployment_in_the_target_environment(
    make_release, environment, owner
):
    release = make_release(state="approved")

    deployment = do_start_deployment(release, actor=owner)

    assert deployment.environment == environment
    assert deployment.state == "deploying"
    assert Release.objects.get(pk=release.pk).state == "deploying"
    assert AuditEvent.objects.filter(verb="deployment.started").count() == 1


def test_it_refuses_to_deploy_an_unapproved_release(make_release, owner):
    release = make_release(state="awaiting_approval")

    with pytest.raises(IllegalTransition):
        do_start_deployment(release, actor=owner)

    assert not release.deployments.exists()


def test_it_supersedes_the_previous_live_release(make_release, environment, owner):
    first = make_release(state="approved")
    first_deployment = do_complete_deployment(
        do_start_deployment(first, actor=owner), actor=owner
    )
    second = make_release(state="approved")

    do_complete_deployment(do_start_deployment(second, actor=owner), actor=owner)

    first_deployment.refresh_from_db()
    assert first_deployment.state == "superseded"
    assert Release.objects.get(pk=first.pk).state == "superseded"
    assert Release.objects.get(pk=second.pk).state == "live"
    assert environment.live_deployment.release == second


def test_it_leaves_other_environments_alone(make_release, make_environment, owner):
    production = make_environment("production")
    staged = make_release(state="approved")
    do_complete_deployment(do_start_deployment(staged, actor=owner), actor=owner)
    prod = make_release(state="approved", target_environment=production)

    do_complete_deployment(do_start_deployment(prod, actor=owner), actor=owner)

    assert Release.objects.get(pk=staged.pk).state == "live"


def test_it_refuses_to_complete_twice(make_release, owner):
    deployment = do_start_deployment(make_release(state="approved"), actor=owner)
    do_complete_deployment(deployment, actor=owner)

    with pytest.raises(Conflict):
        do_complete_deployment(deployment, actor=owner)


@pytest.mark.parametrize(
    ("verification", "state"), [(True, "failed_verification"), (False, "failed")]
)
def test_it_fails_a_deployment(make_release, owner, verification, state):
    release = make_release(state="approved")
    deployment = do_start_deployment(release, actor=owner)

    do_fail_deployment(
        deployment, actor=owner, reason="boom", verification=verification
    )

    deployment.refresh_from_db()
    assert deployment.state == state
    stored = Release.objects.get(pk=release.pk)
    assert stored.state == state
    assert stored.failure_reason == "boom"
