"""The create_api_token management command (controlplane/accounts/management)."""

import io

import pytest
from django.core.management import CommandError, call_command

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent


def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("create_api_token", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def test_it_prints_a_working_token_once(client, owner, team):
    plaintext, note = run(
        "--user",
        "alice",
        "--team",
        "acme",
        "--name",
        "ci",
        "--scopes",
        "read,register,promote",
    )

    token = ApiToken.objects.get()
    assert ApiToken.lookup(plaintext) == token
    assert token.token_hash != plaintext and plaintext not in note
    assert (token.user, token.team, token.name) == (owner, team, "ci")
    assert token.scopes == ["read", "register", "promote"]
    assert AuditEvent.objects.filter(verb="api_token.created").exists()
    response = client.get(
        "/api/v1/releases", headers={"Authorization": f"Bearer {plaintext}"}
    )
    assert response.status_code == 200


def test_it_accepts_the_team_name(owner, team):
    run("--user", "alice", "--team", "Acme ML", "--name", "ci", "--scopes", "read")

    assert ApiToken.objects.get().team == team


def test_it_refuses_an_unknown_scope(owner, team):
    with pytest.raises(CommandError, match="unknown scopes: deploy"):
        run("--user", "alice", "--team", "acme", "--name", "ci", "--scopes", "deploy")
    assert not ApiToken.objects.exists()


def test_it_refuses_a_user_outside_the_team(outsider, team):
    with pytest.raises(CommandError, match="not a member"):
        run("--user", "mallory", "--team", "acme", "--name", "x", "--scopes", "read")
    assert not ApiToken.objects.exists()


def test_it_refuses_an_unknown_user_or_team(owner, team):
    with pytest.raises(CommandError, match="no user"):
        run("--user", "zed", "--team", "acme", "--name", "x", "--scopes", "read")
    with pytest.raises(CommandError, match="no team"):
        run("--user", "alice", "--team", "nope", "--name", "x", "--scopes", "read")
