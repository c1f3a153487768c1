import pytest
from django.test import Client

from controlplane.releases.actions.manifests import do_record_manifest
from controlplane.releases.models import Release
from gpuagent.protocol import FileDigest


def _state(release) -> str:
    return Release.objects.get(pk=release.pk).state


def _confirmed(release, **extra) -> dict:
    return {
        "manifest_digest": release.manifest_digest,
        "comment": "numbers hold",
        "confirmed": "yes",
        **extra,
    }


def test_it_asks_to_confirm_the_full_digest_first(client, teammate, awaiting, deploys):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/approve/",
        {"manifest_digest": release.manifest_digest, "comment": "numbers hold"},
    )

    body = response.content.decode()
    assert response.status_code == 200
    assert (
        f'<code class="digest" id="confirm-digest">{release.manifest_digest}</code>'
        in (body)
    )
    assert 'name="confirmed" value="yes"' in body
    assert "numbers hold" in body
    assert _state(release) == "awaiting_approval"
    assert not release.approvals.exists()
    assert deploys() == []


def test_it_approves_once_confirmed(client, teammate, awaiting, deploys):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.post(f"/releases/{release.pk}/approve/", _confirmed(release))

    assert response.status_code == 302
    assert response.url == f"/releases/{release.pk}/"
    assert _state(release) == "approved"
    approval = release.approvals.get()
    assert (approval.user, approval.comment) == (teammate, "numbers hold")
    assert approval.manifest_digest == release.manifest_digest
    assert deploys() == [(release.pk,)]


def test_it_warns_on_confirmation_that_the_bytes_are_already_live(
    client, teammate, make_live, make_release
):
    live = make_live("0.9.0")
    again = make_release("0.9.1", state="awaiting_approval")
    do_record_manifest(
        again,
        manifest_digest=live.manifest_digest,
        files=[FileDigest(path="m", size_bytes=1, digest="sha256:1")],
    )
    client.force_login(teammate)

    response = client.post(
        f"/releases/{again.pk}/approve/", {"manifest_digest": live.manifest_digest}
    )

    assert b"Same bytes as live" in response.content


def test_it_needs_the_csrf_token(teammate, awaiting):
    release = awaiting("1.0.0")
    client = Client(enforce_csrf_checks=True)
    client.force_login(teammate)

    response = client.post(f"/releases/{release.pk}/approve/", _confirmed(release))

    assert response.status_code == 403
    assert _state(release) == "awaiting_approval"


def test_it_refuses_get(client, teammate, awaiting):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    assert client.get(f"/releases/{release.pk}/approve/").status_code == 405


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_is_403_for_the_registering_user(client, owner, awaiting, confirmed):
    release = awaiting("1.0.0")
    client.force_login(owner)

    response = client.post(
        f"/releases/{release.pk}/approve/", _confirmed(release, confirmed=confirmed)
    )

    assert response.status_code == 403
    assert b"cannot also approve" in response.content
    assert _state(release) == "awaiting_approval"


def test_it_is_403_for_members(client, member, awaiting):
    release = awaiting("1.0.0")
    client.force_login(member)

    response = client.post(f"/releases/{release.pk}/approve/", _confirmed(release))

    assert response.status_code == 403
    assert _state(release) == "awaiting_approval"


def test_it_is_404_for_outsiders(client, outsider, awaiting):
    release = awaiting("1.0.0")
    client.force_login(outsider)

    response = client.post(f"/releases/{release.pk}/approve/", _confirmed(release))

    assert response.status_code == 404
    assert _state(release) == "awaiting_approval"


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_refuses_a_digest_that_changed_since_the_page_loaded(
    client, teammate, awaiting, confirmed
):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/approve/",
        _confirmed(release, manifest_digest="sha256:" + "0" * 64, confirmed=confirmed),
        follow=True,
    )

    assert b"approval is for manifest" in response.content
    assert _state(release) == "awaiting_approval"
    assert not release.approvals.exists()


@pytest.mark.parametrize("sent", [{}, {"manifest_digest": ""}])
def test_it_refuses_an_approval_without_the_reviewed_digest(
    client, teammate, awaiting, sent
):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/approve/", {**sent, "confirmed": "yes"}, follow=True
    )

    assert b"approve needs the manifest digest you reviewed" in response.content
    assert _state(release) == "awaiting_approval"


def test_it_refuses_to_approve_a_release_without_a_manifest(
    client, teammate, make_release
):
    # The page renders an empty hidden digest; that must not approve unhashed bytes.
    release = make_release(state="awaiting_approval")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/approve/",
        {"manifest_digest": "", "confirmed": "yes"},
        follow=True,
    )

    assert response.status_code == 200
    assert _state(release) == "awaiting_approval"
