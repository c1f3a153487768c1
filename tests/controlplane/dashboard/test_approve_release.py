import pytest

from controlplane.releases.models import Release


@pytest.fixture
def deploys(queued):
    return lambda: queued("run_deployment")


@pytest.fixture
def waiting(make_release):
    return make_release(state="awaiting_approval", manifest_digest="sha256:" + "c" * 64)


def test_it_approves_through_the_action(client, teammate, waiting, deploys):
    client.force_login(teammate)

    response = client.post(
        f"/releases/{waiting.pk}/approve/",
        {"comment": "ok", "manifest_digest": waiting.manifest_digest},
    )

    assert response.status_code == 302
    assert Release.objects.get(pk=waiting.pk).state == "approved"
    approval = waiting.approvals.get()
    assert (approval.user, approval.comment) == (teammate, "ok")
    assert approval.manifest_digest == waiting.manifest_digest
    assert deploys() == [(waiting.pk,)]


def test_it_needs_the_csrf_token(teammate, waiting):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(teammate)

    response = client.post(f"/releases/{waiting.pk}/approve/")

    assert response.status_code == 403
    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"


def test_it_refuses_get(client, teammate, waiting):
    client.force_login(teammate)

    assert client.get(f"/releases/{waiting.pk}/approve/").status_code == 405


def test_it_is_403_for_the_registering_user(client, owner, waiting):
    client.force_login(owner)

    response = client.post(f"/releases/{waiting.pk}/approve/")

    assert response.status_code == 403
    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"


def test_it_is_403_for_members(client, member, waiting):
    client.force_login(member)

    assert client.post(f"/releases/{waiting.pk}/approve/").status_code == 403


def test_it_is_404_for_outsiders(client, outsider, waiting):
    client.force_login(outsider)

    assert client.post(f"/releases/{waiting.pk}/approve/").status_code == 404
    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"


def test_it_reports_a_stale_digest_without_approving(client, teammate, waiting):
    client.force_login(teammate)

    response = client.post(
        f"/releases/{waiting.pk}/approve/",
        {"manifest_digest": "sha256:" + "0" * 64},
        follow=True,
    )

    assert b"approval is for manifest" in response.content
    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"


@pytest.mark.parametrize("sent", [{}, {"manifest_digest": ""}])
def test_it_refuses_an_approval_without_the_reviewed_digest(
    client, teammate, waiting, sent
):
    client.force_login(teammate)

    response = client.post(f"/releases/{waiting.pk}/approve/", sent, follow=True)

    assert b"approve needs the manifest digest you reviewed" in response.content
    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"
    assert not waiting.approvals.exists()


def test_it_refuses_to_approve_a_release_without_a_manifest(
    client, teammate, make_release
):
    # The page renders an empty hidden digest; that must not approve unhashed bytes.
    release = make_release(state="awaiting_approval")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/approve/", {"manifest_digest": ""}, follow=True
    )

    assert response.status_code == 200
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
