import pytest
from django.test import Client

from controlplane.releases.models import Release

REASON = "korean slice regressed: 6 flips"


def _stored(release) -> Release:
    return Release.objects.get(pk=release.pk)


def test_it_asks_to_confirm_first(client, teammate, awaiting):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.post(f"/releases/{release.pk}/reject/", {"comment": REASON})

    assert response.status_code == 200
    assert b"Confirm rejection" in response.content
    assert REASON.encode() in response.content
    assert _stored(release).state == "awaiting_approval"


def test_it_rejects_once_confirmed(client, teammate, awaiting):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/reject/", {"comment": REASON, "confirmed": "yes"}
    )

    assert response.status_code == 302
    stored = _stored(release)
    assert (stored.state, stored.failure_reason) == ("rejected", REASON)
    approval = release.approvals.get()
    assert (approval.user, approval.decision, approval.comment) == (
        teammate,
        "reject",
        REASON,
    )


def test_it_rejects_only_the_manifest_the_page_showed(client, teammate, awaiting):
    release = awaiting("1.0.0")
    client.force_login(teammate)
    page = client.get(f"/releases/{release.pk}/")
    shown = f'name="manifest_digest" value="{release.manifest_digest}"'
    assert page.content.decode().count(shown) == 2  # the approve and reject forms
    Release.objects.filter(pk=release.pk).update(manifest_digest="sha256:" + "9" * 64)

    response = client.post(
        f"/releases/{release.pk}/reject/",
        {
            "comment": REASON,
            "confirmed": "yes",
            "manifest_digest": release.manifest_digest,
        },
        follow=True,
    )

    assert b"the manifest changed since it was reviewed" in response.content
    assert _stored(release).state == "awaiting_approval"
    assert not release.approvals.exists()


@pytest.mark.parametrize("comment", ["", "   "])
def test_it_needs_a_comment(client, teammate, awaiting, comment):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/reject/",
        {"comment": comment, "confirmed": "yes"},
        follow=True,
    )

    assert b"a rejection needs a reason" in response.content
    assert _stored(release).state == "awaiting_approval"


def test_it_needs_the_csrf_token(teammate, awaiting):
    release = awaiting("1.0.0")
    client = Client(enforce_csrf_checks=True)
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/reject/", {"comment": REASON, "confirmed": "yes"}
    )

    assert response.status_code == 403
    assert _stored(release).state == "awaiting_approval"


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_is_403_for_members(client, member, awaiting, confirmed):
    release = awaiting("1.0.0")
    client.force_login(member)

    response = client.post(
        f"/releases/{release.pk}/reject/", {"comment": REASON, "confirmed": confirmed}
    )

    assert response.status_code == 403
    assert _stored(release).state == "awaiting_approval"


def test_it_is_404_for_outsiders(client, outsider, awaiting):
    release = awaiting("1.0.0")
    client.force_login(outsider)

    response = client.post(
        f"/releases/{release.pk}/reject/", {"comment": REASON, "confirmed": "yes"}
    )

    assert response.status_code == 404
    assert _stored(release).state == "awaiting_approval"


def test_it_shows_why_a_live_release_cannot_be_rejected(client, teammate, make_live):
    release = make_live("1.0.0")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/reject/", {"comment": REASON}, follow=True
    )

    assert b"illegal release transition live -&gt; rejected" in response.content
    assert b"Confirm rejection" not in response.content
    assert _stored(release).state == "live"


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_is_403_for_the_registrant(client, teammate, make_release, confirmed):
    # Separation of duties both ways: who registered a release can't reject it.
    release = make_release(state="awaiting_approval", actor=teammate)
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/reject/", {"comment": REASON, "confirmed": confirmed}
    )

    assert response.status_code == 403
    assert f"bob registered {release} and cannot also reject it".encode() in (
        response.content
    )
    assert _stored(release).state == "awaiting_approval"
    assert not release.approvals.exists()
