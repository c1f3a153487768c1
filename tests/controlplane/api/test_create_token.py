"""POST /api/v1/tokens: an admin token makes a token in its team, for its user or
(admin role) another member; each scope allowed by that member's role and held by
the calling token. The secret is in the answer only, and works."""

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent
from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/tokens"


def test_it_creates_a_working_token_shown_once(api, admin_token, owner, team):
    response = api.post(URL, {"name": "ci", "scopes": ["read"]}, token=admin_token)

    assert response.status_code == 201, response.content
    assert response["Cache-Control"] == "no-store"
    created = response.json()
    token = ApiToken.objects.get(pk=created["id"])
    assert (token.user, token.team, token.scopes) == (owner, team, ["read"])
    assert created["token"].startswith(created["prefix"])
    assert api.get("/api/v1/releases", token=created["token"]).status_code == 200
    assert created["token"] not in api.get(URL, token=admin_token).content.decode()
    assert AuditEvent.objects.filter(verb="api_token.created").count() == 2


def test_it_creates_one_for_another_member(api, admin_token, teammate):
    body = {"name": "bob-ci", "scopes": ["read", "approve"], "user": "bob"}

    response = api.post(URL, body, token=admin_token)

    # The calling token lacks approve: it can't grant it.
    assert field_names(error_of(response, 403, "forbidden")) == {"scopes"}
    body["scopes"] = ["read"]
    response = api.post(URL, body, token=admin_token)
    assert response.status_code == 201, response.content
    assert ApiToken.objects.get(pk=response.json()["id"]).user == teammate


def test_it_refuses_a_scope_beyond_the_members_role(api, make_token, owner, member):
    token = make_token(owner, "read", "approve", "admin")
    body = {"name": "carol-ci", "scopes": ["approve"], "user": "carol"}

    response = api.post(URL, body, token=token)

    error = error_of(response, 403, "forbidden")
    assert "'approve' scope needs the approver or admin role" in error["message"]
    assert not ApiToken.objects.filter(name="carol-ci").exists()


def test_it_refuses_a_user_outside_the_team(api, admin_token, outsider):
    body = {"name": "x", "scopes": ["read"], "user": "mallory"}

    error_of(api.post(URL, body, token=admin_token), 403, "forbidden")
    unknown = api.post(URL, {**body, "user": "nobody"}, token=admin_token)
    assert field_names(error_of(unknown, 422, "validation_failed")) == {"user"}
    assert not ApiToken.objects.filter(name="x").exists()


def test_it_needs_the_admin_role_for_another_member(api, make_token, teammate, member):
    token = make_token(teammate, "read", "admin")
    body = {"name": "x", "scopes": ["read"], "user": "carol"}

    error_of(api.post(URL, body, token=token), 403, "forbidden")


def test_it_refuses_an_unknown_or_missing_scope(api, admin_token):
    unknown = api.post(URL, {"name": "x", "scopes": ["deploy"]}, token=admin_token)
    empty = api.post(URL, {"name": "x", "scopes": []}, token=admin_token)

    assert field_names(error_of(unknown, 422, "validation_error")) == {"scopes.0"}
    assert field_names(error_of(empty, 422, "validation_error")) == {"scopes"}
