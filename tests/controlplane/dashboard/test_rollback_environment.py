import pytest

from controlplane.releases.actions import (
    do_complete_deployment,
    do_fail_deployment,
    do_start_deployment,
)
from controlplane.releases.models import Release


@pytest.fixture
def broken(make_release, owner):
    """1.0.1 was live, 1.0.2 replaced it and then failed re-verification."""
    old = make_release(state="approved")
    do_complete_deployment(do_start_deployment(old, actor=owner), actor=owner)
    new = make_release(state="approved")
    deployment = do_complete_deployment(
        do_start_deployment(new, actor=owner), actor=owner
    )
    do_fail_deployment(deployment, actor=owner, reason="changed", verification=True)
    return old, new


@pytest.fixture
def deploys(queued):
    return lambda: queued("run_deployment")


def test_it_shows_the_rollback_button_to_approvers(
    client, teammate, broken, environment
):
    client.force_login(teammate)

    response = client.get("/")

    assert f"/environments/{environment.pk}/rollback/".encode() in response.content


def test_it_hides_the_button_when_verification_did_not_fail(
    client, teammate, make_release, owner, environment
):
    release = make_release(state="approved")
    do_complete_deployment(do_start_deployment(release, actor=owner), actor=owner)
    client.force_login(teammate)

    response = client.get("/")

    assert b"/rollback/" not in response.content


def test_it_hides_the_button_from_members(client, member, broken):
    client.force_login(member)

    assert b"/rollback/" not in client.get("/").content


def test_it_rolls_back(client, teammate, broken, environment, deploys):
    old, new = broken
    client.force_login(teammate)

    response = client.post(f"/environments/{environment.pk}/rollback/")

    assert response.status_code == 302
    assert Release.objects.get(pk=new.pk).state == "quarantined"
    assert Release.objects.get(pk=old.pk).state == "deploying"
    assert deploys() == [(old.pk,)]


def test_it_is_403_for_members(client, member, broken, environment):
    client.force_login(member)

    assert client.post(f"/environments/{environment.pk}/rollback/").status_code == 403


def test_it_is_404_for_outsiders(client, outsider, broken, environment):
    _, new = broken
    client.force_login(outsider)

    assert client.post(f"/environments/{environment.pk}/rollback/").status_code == 404
    assert Release.objects.get(pk=new.pk).state == "failed_verification"
