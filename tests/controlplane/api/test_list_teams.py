"""GET /api/v1/teams: a token sees its own team; a dashboard session every team
of its user; nobody sees another's."""

from tests.controlplane.api.helpers import error_of

URL = "/api/v1/teams"


def test_it_lists_the_tokens_team_only(api, owner_token, team, outsider_token):
    response = api.get(URL, token=owner_token)

    assert response.status_code == 200, response.content
    assert [t["slug"] for t in response.json()["items"]] == ["acme"]
    other = api.get(URL, token=outsider_token).json()["items"]
    assert [t["slug"] for t in other] == ["other"]


def test_it_lists_every_team_of_a_signed_in_user(client, api, owner, other_team, team):
    from controlplane.accounts.models import Membership

    Membership.objects.create(team=other_team, user=owner, role="member")
    client.force_login(owner)

    response = api.get(URL)

    assert [t["slug"] for t in response.json()["items"]] == ["acme", "other"]


def test_it_needs_the_read_scope(api, make_token, owner):
    response = api.get(URL, token=make_token(owner, "promote"))

    assert error_of(response, 403, "missing_scope")["scope"] == "read"
