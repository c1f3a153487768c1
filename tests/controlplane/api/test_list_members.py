"""GET /api/v1/teams/{slug}/members: a team's members and roles, to its members
only; another team's is a 404, as one that doesn't exist."""

from tests.controlplane.api.helpers import error_of


def url(slug: str) -> str:
    return f"/api/v1/teams/{slug}/members"


def test_it_lists_members_with_their_roles(api, owner_token, teammate, member):
    response = api.get(url("acme"), token=owner_token)

    assert response.status_code == 200, response.content
    assert response.json()["items"] == [
        {"team": "acme", "user": "alice", "role": "admin"},
        {"team": "acme", "user": "bob", "role": "approver"},
        {"team": "acme", "user": "carol", "role": "member"},
    ]


def test_it_shows_the_outsider_nothing(api, outsider_token, owner):
    error_of(api.get(url("acme"), token=outsider_token), 404, "not_found")
    error_of(api.get(url("nope"), token=outsider_token), 404, "not_found")
    assert api.get(url("other"), token=outsider_token).status_code == 200
