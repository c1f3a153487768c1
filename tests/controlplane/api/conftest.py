"""API tokens for the shared cast (tests/controlplane/conftest.py) and a thin client.

- `owner_token`: owner (admin), scopes read, register, promote — what CI holds;
- `approver_token`: teammate (approver), scopes read, approve;
- `outsider_token`: outsider (admin of other_team), every scope;
- `admin_token`: owner (admin), scopes read, admin — what a team's admin holds;
- `make_token(user, *scopes, of_team=None)` for anything else. Scopes beyond the
  user's role (an approver's token with `admin`) make the token a member could still
  hold: one made while they had the role, before it was lowered. Actions check the
  role again, and the tests of those checks use such tokens.
"""

import json
from typing import Any

import pytest
from django.test import Client

from controlplane.accounts.actions import do_create_api_token
from controlplane.accounts.models import API_SCOPES, ROLE_SCOPES, Membership


@pytest.fixture
def make_token(team):
    def make(user, *scopes: str, of_team=None) -> str:
        membership = Membership.objects.get(team=of_team or team, user=user)
        demoted = not set(scopes) <= set(ROLE_SCOPES[membership.role])
        if demoted:
            Membership.objects.filter(pk=membership.pk).update(role="admin")
        _, plaintext = do_create_api_token(
            user, of_team or team, f"{user.username}-{'-'.join(scopes)}", list(scopes)
        )
        if demoted:
            Membership.objects.filter(pk=membership.pk).update(role=membership.role)
        return plaintext

    return make


@pytest.fixture
def owner_token(make_token, owner) -> str:
    return make_token(owner, "read", "register", "promote")


@pytest.fixture
def approver_token(make_token, teammate) -> str:
    return make_token(teammate, "read", "approve")


@pytest.fixture
def outsider_token(make_token, outsider, other_team) -> str:
    return make_token(outsider, *API_SCOPES, of_team=other_team)


@pytest.fixture
def admin_token(make_token, owner) -> str:
    return make_token(owner, "read", "admin")


class Api:
    """Django's test client speaking JSON with an optional Bearer token."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def _headers(self, token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token is not None else {}

    def get(self, path: str, token: str | None = None, **params: Any):
        return self.client.get(path, params, headers=self._headers(token))

    def post(self, path: str, body: Any = None, token: str | None = None, **kw: Any):
        data = kw.pop("raw", None)
        if data is None:
            data = json.dumps(body) if body is not None else ""
        return self.client.post(
            path,
            data,
            content_type="application/json",
            headers={**self._headers(token), **kw.pop("headers", {})},
            **kw,
        )

    def delete(self, path: str, token: str | None = None):
        return self.client.delete(path, headers=self._headers(token))


@pytest.fixture
def api(client) -> Api:
    return Api(client)
