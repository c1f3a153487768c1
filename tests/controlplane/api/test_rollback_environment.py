from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.fleet.models import Deployment
from tests.controlplane.api.helpers import error_of


def url(environment_id) -> str:
    return f"/api/v1/environments/{environment_id}/rollback"


@pytest.fixture
def rollback_token(make_token, teammate) -> str:
    return make_token(teammate, "read", "promote")


@pytest.fixture
def two_releases(make_release, environment):
    """1.0.0 went live and was superseded by 2.0.0, which is live now."""
    earlier = timezone.now() - timedelta(hours=1)
    old = make_release("1.0.0", state="superseded")
    new = make_release("2.0.0", state="live")
    Deployment.objects.create(
        release=old, environment=environment, state="superseded", started=earlier
    )
    Deployment.objects.create(release=new, environment=environment, state="live")
    return old, new


def test_it_rolls_back_to_the_previous_verified_release(
    api, rollback_token, environment, two_releases, queued
):
    old, new = two_releases

    response = api.post(url(environment.pk), token=rollback_token)

    assert response.status_code == 202, response.content
    data = response.json()
    assert data["deployment"]["release_id"] == old.pk
    assert data["deployment"]["state"] == "deploying"
    assert data["status_url"].endswith(f"/api/v1/releases/{old.pk}")
    assert response["Location"] == data["status_url"]
    old.refresh_from_db()
    new.refresh_from_db()
    assert (old.state, new.state) == ("deploying", "rolled_back")
    assert queued("run_deployment") == [(old.pk,)]


def test_it_says_when_there_is_nothing_to_roll_back_to(
    api, rollback_token, environment, make_release
):
    release = make_release("2.0.0", state="live")
    Deployment.objects.create(release=release, environment=environment, state="live")

    error = error_of(
        api.post(url(environment.pk), token=rollback_token), 409, "conflict"
    )

    assert "no previous verified release" in error["message"]
    release.refresh_from_db()
    assert release.state == "live"


def test_it_refuses_a_member_without_the_approver_role(
    api, make_token, member, environment, two_releases
):
    token = make_token(member, "promote")

    error_of(api.post(url(environment.pk), token=token), 403, "forbidden")
    assert two_releases[1].__class__.objects.get(pk=two_releases[1].pk).state == "live"


def test_it_needs_a_token(api, environment):
    error_of(api.post(url(environment.pk)), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, environment):
    error_of(api.post(url(environment.pk), token="rg_x"), 401, "not_authenticated")


def test_it_needs_the_promote_scope(api, approver_token, environment, two_releases):
    error = error_of(
        api.post(url(environment.pk), token=approver_token), 403, "missing_scope"
    )

    assert error["scope"] == "promote"


def test_it_hides_the_environment_from_an_outsider(
    api, outsider_token, environment, two_releases
):
    error_of(api.post(url(environment.pk), token=outsider_token), 404, "not_found")
    assert two_releases[1].__class__.objects.get(pk=two_releases[1].pk).state == "live"


def test_it_names_a_bad_id(api, rollback_token):
    error_of(api.post(url("prod"), token=rollback_token), 422, "validation_error")
