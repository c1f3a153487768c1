"""GET /api/v1/tokens: a member's own tokens; all of the team's for an admin;
never a secret or its hash; nothing of another team."""

from controlplane.accounts.models import ApiToken
from tests.controlplane.api.helpers import error_of

URL = "/api/v1/tokens"


def names(response) -> set[str]:
    assert response.status_code == 200, response.content
    return {t["name"] for t in response.json()["items"]}


def test_it_lists_the_teams_tokens_to_an_admin(
    api, owner_token, approver_token, outsider_token
):
    response = api.get(URL, token=owner_token)

    assert names(response) == {"alice-read-register-promote", "bob-read-approve"}
    body = response.content.decode()
    for token in ApiToken.objects.all():
        assert token.token_hash not in body
    assert owner_token not in body and approver_token not in body


def test_it_lists_a_members_own_tokens_only(api, owner_token, approver_token):
    assert names(api.get(URL, token=approver_token)) == {"bob-read-approve"}


def test_it_shows_the_outsider_nothing(api, owner_token, outsider_token):
    assert names(api.get(URL, token=outsider_token)) == {
        "mallory-read-register-promote-approve-admin"
    }


def test_it_needs_the_read_scope(api, make_token, owner):
    response = api.get(URL, token=make_token(owner, "admin"))

    assert error_of(response, 403, "missing_scope")["scope"] == "read"
