import pytest
from django.test import Client

from controlplane.audit.models import AuditEvent
from controlplane.releases.actions.approvals import do_reject_release
from controlplane.releases.models import Release

REASON = "re-ran calibration with the Korean prompts"


def _stored(release) -> Release:
    return Release.objects.get(pk=release.pk)


@pytest.fixture
def rejected(awaiting, teammate):
    release = awaiting("1.0.0")
    do_reject_release(release, teammate, comment="korean slice regressed")
    release.refresh_from_db()
    return release


def test_it_offers_reopen_on_a_rejected_release(client, member, rejected):
    client.force_login(member)

    body = client.get(f"/releases/{rejected.pk}/").content.decode()

    assert f'action="/releases/{rejected.pk}/reopen/"' in body
    assert 'id="register-hint"' in body
    assert "POST /api/v1/releases</code>" in body


def test_it_offers_reopen_on_a_failed_release(client, owner, make_release):
    release = make_release("1.0.0", state="failed", failure_reason="gate failed")
    client.force_login(owner)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    assert f'action="/releases/{release.pk}/reopen/"' in body


@pytest.mark.parametrize("state", ["awaiting_approval", "quarantined"])
def test_it_offers_no_reopen_in_other_states(client, owner, make_release, state):
    release = make_release("1.0.0", state=state)
    client.force_login(owner)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    assert "/reopen/" not in body


def test_it_explains_that_a_quarantined_release_needs_a_new_version(
    client, owner, make_release
):
    release = make_release("1.0.0", state="quarantined")
    client.force_login(owner)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    assert "A quarantined release can't be reopened" in body
    assert "POST /api/v1/releases</code>" in body


def test_it_asks_to_confirm_first(client, member, rejected):
    client.force_login(member)

    response = client.post(f"/releases/{rejected.pk}/reopen/", {"reason": REASON})

    assert response.status_code == 200
    assert b"Confirm reopen" in response.content
    assert REASON.encode() in response.content
    assert _stored(rejected).state == "rejected"


def test_it_reopens_once_confirmed(client, member, rejected):
    client.force_login(member)

    response = client.post(
        f"/releases/{rejected.pk}/reopen/", {"reason": REASON, "confirmed": "yes"}
    )

    assert response.status_code == 302
    assert _stored(rejected).state == "registered"
    event = AuditEvent.objects.get(verb="release.reopened", object_id=str(rejected.pk))
    assert (event.actor_user, event.after["reason"]) == (member, REASON)


@pytest.mark.parametrize("confirmed", ["", "yes"])
@pytest.mark.parametrize("reason", ["", "   "])
def test_it_needs_a_reason(client, member, rejected, reason, confirmed):
    client.force_login(member)

    response = client.post(
        f"/releases/{rejected.pk}/reopen/",
        {"reason": reason, "confirmed": confirmed},
        follow=True,
    )

    assert b"reopening needs a reason" in response.content
    assert b"Confirm reopen" not in response.content
    assert _stored(rejected).state == "rejected"


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_refuses_a_release_that_is_not_rejected_or_failed(
    client, owner, make_live, confirmed
):
    release = make_live("1.0.0")
    client.force_login(owner)

    response = client.post(
        f"/releases/{release.pk}/reopen/",
        {"reason": REASON, "confirmed": confirmed},
        follow=True,
    )

    assert b"only a rejected or failed release can be reopened" in response.content
    assert b"Confirm reopen" not in response.content
    assert _stored(release).state == "live"


def test_it_needs_the_csrf_token(member, rejected):
    client = Client(enforce_csrf_checks=True)
    client.force_login(member)

    response = client.post(
        f"/releases/{rejected.pk}/reopen/", {"reason": REASON, "confirmed": "yes"}
    )

    assert response.status_code == 403
    assert _stored(rejected).state == "rejected"


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_is_404_for_outsiders(client, outsider, rejected, confirmed):
    client.force_login(outsider)

    response = client.post(
        f"/releases/{rejected.pk}/reopen/", {"reason": REASON, "confirmed": confirmed}
    )

    assert response.status_code == 404
    assert _stored(rejected).state == "rejected"


def test_it_only_takes_posts(client, member, rejected):
    client.force_login(member)

    assert client.get(f"/releases/{rejected.pk}/reopen/").status_code == 405


def test_it_sends_an_ended_session_to_login(client, rejected):
    response = client.post(f"/releases/{rejected.pk}/reopen/", {"reason": REASON})

    assert response.status_code == 302
    assert "/accounts/login/" in response["Location"]
    assert _stored(rejected).state == "rejected"
