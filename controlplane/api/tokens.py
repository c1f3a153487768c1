"""API tokens through the API: list (read scope: the caller's own, or all of the
team's for an admin), create and revoke (admin scope). A person without a token
makes their first one on the dashboard's Tokens page; an admin can make one for
a member here (a CI account, say), never with a scope the member's role doesn't
allow or the calling token doesn't hold."""

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from ninja import Query, Router, Status

from controlplane.accounts.actions import do_create_api_token, do_revoke_api_token
from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    ApiTokenCreatedOut,
    ApiTokenIn,
    ApiTokenOut,
    ObjectId,
    Page,
    PageParams,
)
from controlplane.api.scoping import api_tokens, page, principal_of
from controlplane.api.teams import user_named

router = Router(tags=["tokens"])


@router.get(
    "/tokens",
    auth=read_auth(),
    response={200: Page[ApiTokenOut], **READ_ERRORS},
    summary="List API tokens: the caller's own, all of the team's for an admin",
    description="Never a secret: `prefix` tells tokens apart.",
)
def list_tokens(request: HttpRequest, params: Query[PageParams]) -> dict:
    return page(api_tokens(principal_of(request)), params)


@router.post(
    "/tokens",
    auth=token_auth("admin"),
    response={201: ApiTokenCreatedOut, **WRITE_ERRORS},
    summary="Create an API token in the token's team; the secret is in this answer "
    "only",
    description="For the caller, or (admin role) for another member named by "
    "`user`. Each scope must be allowed by that member's role (approve: approver "
    "or admin; admin: admin) and held by the calling token.",
)
def create_token(
    request: HttpRequest, payload: ApiTokenIn, response: HttpResponse
) -> Status:
    principal = principal_of(request)
    user = principal.user
    if payload.user is not None:
        user = user_named(payload.user, field="user")
    token, plaintext = do_create_api_token(
        user,
        principal.token.team,
        payload.name,
        list(payload.scopes),
        actor=principal.token,
    )
    response["Cache-Control"] = "no-store"
    return Status(201, {**token.to_dict(), "token": plaintext})


@router.delete(
    "/tokens/{token_id}",
    auth=token_auth("admin"),
    response={204: None, **WRITE_ERRORS},
    summary="Revoke an API token (its user, or the team's admins)",
    description="It stops working at once and stays listed, revoked. Idempotent.",
)
def revoke_token(request: HttpRequest, token_id: ObjectId) -> Status:
    principal = principal_of(request)
    token = get_object_or_404(api_tokens(principal), pk=token_id)
    do_revoke_api_token(token, actor=principal.token)
    return Status(204, None)
