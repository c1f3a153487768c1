"""What every operation does with credentials; the operations come from the URL
resolver (see helpers.api_operations), so a new endpoint is covered without being
listed here."""

import pytest

from controlplane.accounts.actions import do_revoke_api_token
from controlplane.accounts.models import ApiToken, Membership
from tests.controlplane.api.helpers import api_operations, concrete_path, error_of


def call(client, method: str, path: str, **headers):
    return client.generic(
        method, concrete_path(path), "{}", "application/json", headers=headers
    )


@pytest.fixture
def operations(client, db) -> set[tuple[str, str]]:
    found = api_operations(client)
    assert len(found) >= 12
    return found


def test_it_answers_401_without_credentials_everywhere(client, operations):
    for path, method in operations:
        response = call(client, method, path)
        error_of(response, 401, "not_authenticated")
        assert response["WWW-Authenticate"].startswith("Bearer"), (method, path)


def test_it_answers_401_for_a_bad_token_everywhere(client, operations):
    for path, method in operations:
        response = call(client, method, path, Authorization="Bearer rg_not-a-token")
        error_of(response, 401, "not_authenticated")


def test_it_answers_401_for_another_auth_scheme(client, operations, owner_token):
    for path, method in operations:
        response = call(client, method, path, Authorization=f"Basic {owner_token}")
        error_of(response, 401, "not_authenticated")


def test_it_answers_401_for_a_revoked_token(client, operations, owner_token):
    do_revoke_api_token(ApiToken.objects.get(prefix=owner_token[:8]))

    for path, method in operations:
        response = call(client, method, path, Authorization=f"Bearer {owner_token}")
        error_of(response, 401, "not_authenticated")


def test_it_answers_401_once_the_user_left_the_team(api, owner, team, owner_token):
    Membership.objects.filter(team=team, user=owner).delete()

    error_of(api.get("/api/v1/releases", token=owner_token), 401, "not_authenticated")


def test_it_answers_401_for_an_inactive_user(api, owner, owner_token):
    owner.is_active = False
    owner.save()

    error_of(api.get("/api/v1/releases", token=owner_token), 401, "not_authenticated")


def test_it_records_when_a_token_was_last_used(api, owner_token):
    token = ApiToken.objects.get(prefix=owner_token[:8])
    assert token.last_used is None

    api.get("/api/v1/releases", token=owner_token)

    token.refresh_from_db()
    assert token.last_used is not None


def test_it_stores_only_the_tokens_hash(owner_token):
    token = ApiToken.objects.get(prefix=owner_token[:8])

    assert owner_token not in (token.token_hash, token.name)
    assert ApiToken.lookup(owner_token) == token


def test_it_lets_a_session_read_but_not_write(client, owner, operations):
    client.force_login(owner)

    for path, method in operations:
        response = call(client, method, path)
        if method == "GET":
            # Reads go through; 404 is the (empty) team's answer for id 1.
            assert response.status_code in (200, 404), (method, path, response)
        else:
            # Writes are for tokens only, so a session can't be CSRF'd into one.
            error_of(response, 401, "not_authenticated")


def test_it_answers_json_for_an_unknown_path_and_method(api, owner_token):
    error_of(api.get("/api/v1/nothing/here", token=owner_token), 404, "not_found")
    response = api.client.delete("/api/v1/releases")
    error = error_of(response, 405, "method_not_allowed")
    assert "GET" in response["Allow"] and "DELETE" in error["message"]
