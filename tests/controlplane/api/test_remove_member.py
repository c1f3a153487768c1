"""DELETE /api/v1/teams/{slug}/members/{username}: a team's admins remove a
member, whose tokens of the team are revoked with it (they would otherwise come
back should the user be added again)."""

from controlplane.accounts.models import ApiToken, Membership
from controlplane.audit.models import AuditEvent
from tests.controlplane.api.helpers import error_of


def url(username: str, slug: str = "acme") -> str:
    return f"/api/v1/teams/{slug}/members/{username}"


def test_it_removes_a_member_and_revokes_their_tokens(
    api, admin_token, approver_token, team, teammate
):
    assert api.get("/api/v1/releases", token=approver_token).status_code == 200

    response = api.delete(url("bob"), token=admin_token)

    assert response.status_code == 204, response.content
    assert not Membership.objects.filter(team=team, user=teammate).exists()
    assert ApiToken.objects.get(user=teammate).revoked is not None
    error_of(
        api.get("/api/v1/releases", token=approver_token), 401, "not_authenticated"
    )
    assert AuditEvent.objects.filter(verb="team.member_removed").count() == 1
    assert AuditEvent.objects.filter(verb="api_token.revoked").count() == 1


def test_it_keeps_the_last_admin(api, admin_token, team, owner):
    error_of(api.delete(url("alice"), token=admin_token), 409, "conflict")

    assert Membership.objects.filter(team=team, user=owner).exists()


def test_it_shows_the_outsider_nothing(api, outsider_token, team, teammate):
    error_of(api.delete(url("bob"), token=outsider_token), 404, "not_found")

    assert Membership.objects.filter(team=team, user=teammate).exists()
    # In their own team the member is found (and kept: the last admin).
    error_of(api.delete(url("mallory", "other"), token=outsider_token), 409, "conflict")


def test_it_needs_the_admin_scope(api, owner_token, team, teammate):
    response = api.delete(url("bob"), token=owner_token)

    assert error_of(response, 403, "missing_scope")["scope"] == "admin"
    assert Membership.objects.filter(team=team, user=teammate).exists()
