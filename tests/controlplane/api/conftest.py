"""API tokens for the shared cast (tests/controlplane/conftest.py) and a thin client.

- `owner_token`: owner (admin), scopes read, register, promote — what CI holds;
- `approver_token`: teammate (approver), scopes read, approve;
- `outsider_token`: outsider (admin of other_team), every scope;
- `make_token(user, *scopes, team=None)` for anything else.
"""

import json
from typing import Any

import pytest
from django.test import Client

from controlplane.accounts.actions import do_create_api_token
from controlplane.accounts.models import API_SCOPES


@pytest.fixture
def make_token(team):
    def make(user, *scopes: str, of_team=None) -> str:
        _, plaintext = do_create_api_token(
            user, of_team or team, f"{user.username}-{'-'.join(scopes)}", list(scopes)
        )
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


@pytest.fixture
def api(client) -> Api:
    return Api(client)
