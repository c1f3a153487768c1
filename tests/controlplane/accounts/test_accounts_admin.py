"""The admin site's teams, members and tokens (controlplane/accounts/admin.py):
an operator adds a token and sees its secret once, in a message; every write goes
through the accounts actions (audited, same rules as the API)."""

import re

import pytest

from controlplane.accounts.actions import do_create_api_token
from controlplane.accounts.models import ApiToken, Membership, Team
from controlplane.audit.models import AuditEvent

TOKENS = "/admin/accounts/apitoken/"
SECRET = re.compile(r"copy it now: (rg_\S+)")


def add_token(client, **fields):
    return client.post(f"{TOKENS}add/", fields, follow=True)


def test_it_adds_a_token_and_shows_its_secret_once(
    admin_client, admin_user, owner, team
):
    response = add_token(
        admin_client, user=owner.pk, team=team.pk, name="ci", scopes=["read", "promote"]
    )

    assert response.status_code == 200
    [secret] = [
        SECRET.search(str(m)).group(1)
        for m in response.context["messages"]
        if SECRET.search(str(m))
    ]
    token = ApiToken.objects.get()
    assert ApiToken.lookup(secret) == token
    assert token.scopes == ["read", "promote"]
    releases = admin_client.get(
        "/api/v1/releases", headers={"Authorization": f"Bearer {secret}"}
    )
    assert releases.status_code == 200
    assert AuditEvent.objects.get(verb="api_token.created").actor_user == admin_user
    for page in (TOKENS, f"{TOKENS}{token.pk}/change/"):
        assert secret not in admin_client.get(page).content.decode()


def test_it_refuses_a_scope_beyond_the_users_role(admin_client, member, team):
    response = add_token(
        admin_client, user=member.pk, team=team.pk, name="x", scopes=["approve"]
    )

    assert "needs the approver or admin role" in response.content.decode()
    assert not ApiToken.objects.exists()


def test_it_revokes_tokens_and_never_deletes_them(admin_client, owner, team):
    token, plaintext = do_create_api_token(owner, team, "ci", ["read"])

    admin_client.post(TOKENS, {"action": "revoke", "_selected_action": [token.pk]})

    assert ApiToken.lookup(plaintext) is None
    assert AuditEvent.objects.filter(verb="api_token.revoked").count() == 1
    assert admin_client.get(f"{TOKENS}{token.pk}/delete/").status_code == 403


def test_it_creates_a_team_through_the_action(admin_client, admin_user, db):
    admin_client.post(
        "/admin/accounts/team/add/",
        {
            "name": "Search",
            "slug": "search",
            "source_roots": "[]",
            "memberships-TOTAL_FORMS": "0",
            "memberships-INITIAL_FORMS": "0",
        },
    )

    team = Team.objects.get(slug="search")
    assert (
        AuditEvent.objects.get(verb="team.created", team=team).actor_user == admin_user
    )


def test_it_removes_a_member_with_their_tokens(admin_client, owner, teammate, team):
    _, plaintext = do_create_api_token(teammate, team, "bob-ci", ["read"])
    membership = Membership.objects.get(user=teammate)

    admin_client.post(
        f"/admin/accounts/membership/{membership.pk}/delete/", {"post": "yes"}
    )

    assert not Membership.objects.filter(pk=membership.pk).exists()
    assert ApiToken.lookup(plaintext) is None


def test_it_keeps_the_last_admin(admin_client, owner, team):
    membership = Membership.objects.get(user=owner)
    url = f"/admin/accounts/membership/{membership.pk}/"

    deleting = admin_client.post(f"{url}delete/", {"post": "yes"})
    demoting = admin_client.post(f"{url}change/", {"role": "member"})

    assert deleting.status_code == 403
    assert "only admin of team acme" in demoting.content.decode()
    assert Membership.objects.get(pk=membership.pk).role == "admin"


@pytest.mark.parametrize("page", ["team", "membership", "apitoken"])
def test_it_shows_the_add_forms(admin_client, page, db):
    assert admin_client.get(f"/admin/accounts/{page}/add/").status_code == 200
