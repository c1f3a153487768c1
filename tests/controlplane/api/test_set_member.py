"""PUT /api/v1/teams/{slug}/members/{username}: a team's admins add users and set
roles (admin scope and admin role); the last admin can't step down; an outsider
gets a 404 and changes nothing."""

from controlplane.accounts.models import Membership
from controlplane.audit.models import AuditEvent
from tests.controlplane.api.helpers import error_of, field_names, put_json


def url(username: str, slug: str = "acme") -> str:
    return f"/api/v1/teams/{slug}/members/{username}"


def role_of(team, user) -> str | None:
    membership = Membership.objects.filter(team=team, user=user).first()
    return membership.role if membership else None


def test_it_adds_a_user_and_audits_it(api, admin_token, team, outsider):
    response = put_json(api, url("mallory"), {"role": "member"}, admin_token)

    assert response.status_code == 200, response.content
    assert response.json() == {"team": "acme", "user": "mallory", "role": "member"}
    assert role_of(team, outsider) == "member"
    event = AuditEvent.objects.get(verb="team.member_set", team=team)
    assert event.actor_name.startswith("token:")
    assert event.after == {"team": "acme", "user": "mallory", "role": "member"}


def test_it_sets_a_role(api, admin_token, team, teammate):
    response = put_json(api, url("bob"), {"role": "admin"}, admin_token)

    assert response.status_code == 200, response.content
    assert role_of(team, teammate) == "admin"


def test_it_needs_the_admin_role(api, make_token, team, teammate, member):
    # A token with the admin scope, its user no longer admin.
    token = make_token(teammate, "read", "admin")

    response = put_json(api, url("carol"), {"role": "approver"}, token)

    error_of(response, 403, "forbidden")
    assert role_of(team, member) == "member"


def test_it_shows_the_outsider_nothing(api, outsider_token, team, owner, teammate):
    response = put_json(api, url("bob"), {"role": "member"}, outsider_token)

    error_of(response, 404, "not_found")
    assert role_of(team, teammate) == "approver"
    own = put_json(api, url("mallory", "other"), {"role": "admin"}, outsider_token)
    assert own.status_code == 200, own.content  # in their own team, it works


def test_it_keeps_an_admin(api, admin_token, team, owner):
    response = put_json(api, url("alice"), {"role": "member"}, admin_token)

    assert field_names(error_of(response, 409, "conflict")) == {"role"}
    assert role_of(team, owner) == "admin"


def test_it_refuses_an_unknown_user_or_role(api, admin_token, teammate):
    error_of(
        put_json(api, url("nobody"), {"role": "member"}, admin_token), 404, "not_found"
    )
    bad_role = put_json(api, url("bob"), {"role": "owner"}, admin_token)

    assert field_names(error_of(bad_role, 422, "validation_error")) == {"role"}
