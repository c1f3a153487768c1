import pytest
from django.test import Client

from controlplane.dashboard.views import environments as environment_views
from controlplane.fleet.models import Deployment
from controlplane.releases.actions.deployments import do_fail_deployment
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Release


@pytest.fixture
def broken(make_live, deploys):
    """0.9.0 was live, 0.9.5 replaced it, then 0.9.5 failed re-verification."""
    old = make_live("0.9.0")
    new = make_live("0.9.5")
    deployment = Deployment.objects.get(release=new)
    do_fail_deployment(
        deployment, actor="system:worker", reason="changed", verification=True
    )
    deploys.clear()
    return old, new


def _state(release) -> str:
    return Release.objects.get(pk=release.pk).state


def test_it_asks_to_confirm_naming_both_releases(client, teammate, broken, environment):
    old, new = broken
    client.force_login(teammate)

    response = client.post(f"/environments/{environment.pk}/rollback/")

    body = response.content.decode()
    assert response.status_code == 200
    assert f"Confirm rollback to {old}" in body
    assert old.manifest_digest in body
    assert f'name="target_release_id" value="{old.pk}"' in body
    assert "It will be quarantined" in body
    assert response.context["target_verification"].ok is True
    assert _state(new) == "failed_verification"


def test_it_rolls_back_once_confirmed(client, teammate, broken, environment, deploys):
    old, new = broken
    client.force_login(teammate)

    response = client.post(
        f"/environments/{environment.pk}/rollback/",
        {"confirmed": "yes", "target_release_id": old.pk},
    )

    assert response.status_code == 302
    assert response.url == "/environments/"
    assert _state(new) == "quarantined"
    assert _state(old) == "deploying"
    assert deploys() == [(old.pk,)]


def test_it_refuses_when_the_target_changed_since_the_page_loaded(
    client, teammate, broken, environment, deploys
):
    old, new = broken
    client.force_login(teammate)

    response = client.post(
        f"/environments/{environment.pk}/rollback/",
        {"confirmed": "yes", "target_release_id": new.pk},
        follow=True,
    )

    assert b"the rollback target of acme/staging changed" in response.content
    assert _state(new) == "failed_verification"
    assert deploys() == []


def test_it_refuses_a_target_that_changes_before_the_rollback_commits(
    client, teammate, make_live, environment, deploys, monkeypatch
):
    oldest, shown, live = make_live("0.9.0"), make_live("0.9.3"), make_live("0.9.5")
    deploys.clear()
    roll_back = environment_views.do_rollback_environment

    def shown_target_quarantined_first(*args, **kwargs):
        # Between the view's reading and the action: the target's warm copy fails
        # its re-verification, so the target would now be 0.9.0, never shown.
        do_transition_release(
            shown, "quarantined", actor="system:worker", reason="changed"
        )
        return roll_back(*args, **kwargs)

    monkeypatch.setattr(
        environment_views, "do_rollback_environment", shown_target_quarantined_first
    )
    client.force_login(teammate)

    response = client.post(
        f"/environments/{environment.pk}/rollback/",
        {"confirmed": "yes", "target_release_id": shown.pk},
        follow=True,
    )

    assert b"the rollback target of acme/staging changed" in response.content
    assert (_state(live), _state(oldest)) == ("live", "superseded")
    assert deploys() == []


def test_it_explains_when_there_is_nothing_to_roll_back_to(
    client, teammate, make_live, environment
):
    make_live("0.9.0")
    client.force_login(teammate)

    response = client.post(f"/environments/{environment.pk}/rollback/", follow=True)

    assert b"has no previous verified release to roll back to" in response.content


def test_it_needs_the_csrf_token(teammate, broken, environment):
    old, new = broken
    client = Client(enforce_csrf_checks=True)
    client.force_login(teammate)

    response = client.post(
        f"/environments/{environment.pk}/rollback/",
        {"confirmed": "yes", "target_release_id": old.pk},
    )

    assert response.status_code == 403
    assert _state(new) == "failed_verification"


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_is_403_for_members(client, member, broken, environment, confirmed):
    old, new = broken
    client.force_login(member)

    response = client.post(
        f"/environments/{environment.pk}/rollback/",
        {"confirmed": confirmed, "target_release_id": old.pk},
    )

    assert response.status_code == 403
    assert _state(new) == "failed_verification"


def test_it_is_404_for_outsiders(client, outsider, broken, environment):
    old, new = broken
    client.force_login(outsider)

    response = client.post(
        f"/environments/{environment.pk}/rollback/",
        {"confirmed": "yes", "target_release_id": old.pk},
    )

    assert response.status_code == 404
    assert _state(new) == "failed_verification"
