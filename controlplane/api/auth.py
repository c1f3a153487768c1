"""Who is calling: per-client API tokens (Bearer), or a dashboard session for reads.

Every endpoint declares its auth as `auth=token_auth("<scope>")` (tokens only) or
`auth=read_auth()` (a token with the read scope, or a logged-in dashboard user). The
callable leaves a `Principal` in `request.auth`:

- no credentials at all -> ninja answers 401;
- an Authorization header that is not a live token -> 401 (never falls through to the
  session, so a bad token is always reported as a bad token);
- a live token without the endpoint's scope -> 403 naming the scope.
"""

from dataclasses import dataclass, field

from django.contrib.auth.models import AbstractBaseUser
from django.http import HttpRequest
from ninja.errors import AuthenticationError
from ninja.security import HttpBearer, SessionAuth

from controlplane.accounts.actions import do_touch_api_token
from controlplane.accounts.models import API_SCOPES, ApiToken, Membership
from controlplane.api.errors import MissingScope


@dataclass(frozen=True)
class Principal:
    """The authenticated caller, as the views see it."""

    user: AbstractBaseUser
    token: ApiToken | None
    # Teams whose objects this caller may see; a token is bound to exactly one team.
    team_ids: frozenset[int]
    scopes: frozenset[str] = field(default_factory=frozenset)


class ApiTokenAuth(HttpBearer):
    def __init__(self, scope: str) -> None:
        if scope not in API_SCOPES:
            raise ValueError(f"unknown scope {scope!r}")
        self.scope = scope
        super().__init__()

    def __call__(self, request: HttpRequest) -> Principal | None:
        header = request.headers.get("Authorization")
        if header is None:
            return None  # let the next auth method (session) try
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError()
        return self.authenticate(request, token.strip())

    def authenticate(self, request: HttpRequest, token: str) -> Principal:
        api_token = ApiToken.lookup(token)
        # lookup() already skips revoked tokens and inactive users.
        if api_token is None:
            raise AuthenticationError()
        # A token outlives nothing: once its user leaves the team it stops working.
        if not Membership.objects.filter(
            team_id=api_token.team_id, user_id=api_token.user_id
        ).exists():
            raise AuthenticationError()
        if self.scope not in api_token.scopes:
            raise MissingScope(self.scope)
        do_touch_api_token(api_token)
        return Principal(
            user=api_token.user,
            token=api_token,
            team_ids=frozenset({api_token.team_id}),
            scopes=frozenset(api_token.scopes),
        )


class DashboardSessionAuth(SessionAuth):
    """A logged-in dashboard user may read the objects of every team they belong to.

    ninja's SessionAuth checks CSRF before it knows whether anyone is logged in, which
    would answer an anonymous POST with 403; check for a user first so that it is 401.
    """

    def _get_key(self, request: HttpRequest) -> str | None:
        if not request.user.is_authenticated:
            return None
        return super()._get_key(request)

    def authenticate(self, request: HttpRequest, key: str | None) -> Principal | None:
        user = request.user
        if not user.is_authenticated or not user.is_active:
            return None
        team_ids = frozenset(
            Membership.objects.filter(user=user).values_list("team_id", flat=True)
        )
        return Principal(
            user=user, token=None, team_ids=team_ids, scopes=frozenset({"read"})
        )


def token_auth(scope: str) -> list:
    return [ApiTokenAuth(scope)]


def read_auth() -> list:
    return [ApiTokenAuth("read"), DashboardSessionAuth()]
