"""/tokens/<id>/revoke/: its user or the team's admin revokes a token, after a
confirmation page; it stops working; audited; anyone else gets a 404."""

import pytest

from controlplane.accounts.actions import do_create_api_token
from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent


@pytest.fixture
def carols(member, team):
    return do_create_api_token(member, team, "carol-ci", ["read"])


def url(token) -> str:
    return f"/tokens/{token.pk}/revoke/"


@pytest.mark.parametrize("who", ["member", "owner"])
def test_it_revokes_after_a_confirmation(client, carols, request, who):
    token, plaintext = carols
    user = request.getfixturevalue(who)
    client.force_login(user)

    confirm = client.post(url(token))

    assert confirm.status_code == 200
    assert "Confirm revoking carol-ci" in confirm.content.decode()
    assert ApiToken.lookup(plaintext) == token
    done = client.post(url(token), {"confirmed": "yes"}, follow=True)
    assert done.redirect_chain[-1][0] == "/tokens/"
    assert "it no longer works" in done.content.decode()
    assert ApiToken.lookup(plaintext) is None
    assert AuditEvent.objects.get(verb="api_token.revoked").actor_user == user


def test_it_shows_others_tokens_to_nobody_else(
    client, carols, member, teammate, outsider
):
    token, plaintext = carols
    for user in (teammate, outsider):
        client.force_login(user)

        assert client.post(url(token), {"confirmed": "yes"}).status_code == 404

    assert ApiToken.lookup(plaintext) == token
    client.force_login(member)
    assert client.post(url(token)).status_code == 200  # its user is asked to confirm


def test_it_says_a_revoked_token_is_revoked(client, carols, member):
    token, _ = carols
    client.force_login(member)
    client.post(url(token), {"confirmed": "yes"})

    again = client.post(url(token), {"confirmed": "yes"}, follow=True)

    assert "was revoked already" in again.content.decode()
    assert AuditEvent.objects.filter(verb="api_token.revoked").count() == 1


def test_it_takes_only_a_post(client, carols, member):
    client.force_login(member)

    assert client.get(url(carols[0])).status_code == 405
