"""/tokens/: the signed-in user's API tokens (a team admin: the team's), by prefix,
never a secret or its hash; nothing of another team."""

from controlplane.accounts.actions import do_create_api_token


def test_it_lists_a_members_own_tokens_by_prefix(client, owner, teammate, team):
    mine, plaintext = do_create_api_token(teammate, team, "bob-ci", ["read"])
    do_create_api_token(owner, team, "alice-ci", ["read", "admin"])
    client.force_login(teammate)

    body = client.get("/tokens/").content.decode()

    assert "bob-ci" in body and f"{mine.prefix}…" in body
    assert "alice-ci" not in body
    assert plaintext not in body and mine.token_hash not in body
    assert f'action="/tokens/{mine.pk}/revoke/"' in body


def test_it_lists_the_teams_tokens_to_its_admin(client, owner, teammate, team):
    bobs, _ = do_create_api_token(teammate, team, "bob-ci", ["read"])
    client.force_login(owner)

    body = client.get("/tokens/").content.decode()

    assert "bob-ci" in body
    assert f'action="/tokens/{bobs.pk}/revoke/"' in body


def test_it_shows_the_outsider_nothing(client, owner, team, outsider):
    do_create_api_token(owner, team, "alice-ci", ["read"])
    client.force_login(outsider)

    body = client.get("/tokens/").content.decode()

    assert "alice-ci" not in body
    assert "No tokens yet." in body


def test_it_needs_a_login(client, db):
    response = client.get("/tokens/")

    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")
