"""/tokens/new/: a member makes an API token in one of their teams with scopes
their role allows; the answer to the post shows the secret, the only time it is
shown; audited as done by the member; CSRF-protected."""

import re

from django.test import Client

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent

URL = "/tokens/new/"


def test_it_offers_the_users_teams_and_ticks_read_only(client, member, other_team):
    client.force_login(member)

    response = client.get(URL)

    form = response.context["form"]
    assert [label for _, label in form.fields["team"].choices] == ["acme"]
    body = response.content.decode()
    assert "<strong>acme</strong> (member): read, register, promote" in body
    ticked = re.findall(
        r'<input type="checkbox" name="scopes" value="(\w+)"[^>]* checked', body
    )
    assert ticked == ["read"]


def test_it_creates_a_token_and_shows_its_secret_once(client, member, team):
    client.force_login(member)

    response = client.post(
        URL, {"team": team.pk, "name": "carol-ci", "scopes": ["read", "promote"]}
    )

    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    token = ApiToken.objects.get(name="carol-ci")
    plaintext = response.context["plaintext"]
    assert ApiToken.lookup(plaintext) == token
    assert f'id="token-secret">{plaintext}</code>' in response.content.decode()
    assert (token.user, token.team, token.scopes) == (member, team, ["read", "promote"])
    event = AuditEvent.objects.get(verb="api_token.created")
    assert (event.actor_user, event.team) == (member, team)
    assert plaintext not in client.get("/tokens/").content.decode()


def test_it_refuses_a_scope_beyond_the_users_role(client, member, team):
    client.force_login(member)

    response = client.post(
        URL, {"team": team.pk, "name": "x", "scopes": ["read", "approve"]}
    )

    assert response.status_code == 400
    assert "not allowed for your role in acme (member): approve" in (
        response.content.decode()
    )
    assert not ApiToken.objects.exists()


def test_it_refuses_another_teams_token(client, member, other_team):
    client.force_login(member)

    response = client.post(
        URL, {"team": other_team.pk, "name": "x", "scopes": ["read"]}
    )

    assert response.status_code == 400
    assert "team" in response.context["form"].errors
    assert not ApiToken.objects.exists()


def test_it_refuses_a_post_without_the_csrf_token(member, team):
    client = Client(enforce_csrf_checks=True)
    client.force_login(member)

    response = client.post(URL, {"team": team.pk, "name": "x", "scopes": ["read"]})

    assert response.status_code == 403
    assert not ApiToken.objects.exists()
