"""Teams, their members and new users. Teams are made by the site's operators
(staff or superuser accounts); everything inside a team by its admins, with a token
of the team that has the admin scope. Reads need the read scope and show the
caller's team(s) only."""

from django.contrib.auth import get_user_model
from django.contrib.auth.tokens import default_token_generator
from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode
from ninja import Query, Router, Status

from controlplane.accounts.actions import (
    do_add_member,
    do_create_team,
    do_create_user,
    do_remove_member,
)
from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    MembershipIn,
    MembershipOut,
    Page,
    PageParams,
    TeamIn,
    TeamOut,
    UserCreatedOut,
    UserIn,
)
from controlplane.api.scoping import get_team, memberships, page, principal_of, teams
from controlplane.errors import ValidationFailed

router = Router(tags=["teams"])


def user_named(username: str, *, field: str):
    """The user called `username`, or a 422 naming `field`."""
    user_model = get_user_model()
    user = user_model.objects.filter(**{user_model.USERNAME_FIELD: username}).first()
    if user is None:
        raise ValidationFailed(f"no user {username!r}", field=field)
    return user


def set_password_url(request: HttpRequest, user) -> str:
    """A one-time link where `user` sets a password: Django's password reset
    confirmation (the token is void once the password changes, or after
    PASSWORD_RESET_TIMEOUT)."""
    path = reverse(
        "password_reset_confirm",
        kwargs={
            "uidb64": urlsafe_base64_encode(force_bytes(user.pk)),
            "token": default_token_generator.make_token(user),
        },
    )
    return request.build_absolute_uri(path)


@router.get(
    "/teams",
    auth=read_auth(),
    response={200: Page[TeamOut], **READ_ERRORS},
    summary="List the caller's teams (a token: its own team)",
)
def list_teams(request: HttpRequest, params: Query[PageParams]) -> dict:
    return page(teams(principal_of(request)), params)


@router.post(
    "/teams",
    auth=token_auth("admin"),
    response={201: TeamOut, **WRITE_ERRORS},
    summary="Create a team (staff or superuser accounts only)",
    description="The token's user must be staff (is_staff) or a superuser: teams "
    "are the site's operators' to make. `admin` (default: the caller) becomes its "
    "first member, with the admin role; that person then adds members and makes "
    "tokens for the new team (a token works for the team it was made in).",
)
def create_team(request: HttpRequest, payload: TeamIn) -> Status:
    principal = principal_of(request)
    admin = principal.user
    if payload.admin is not None:
        admin = user_named(payload.admin, field="admin")
    team = do_create_team(
        payload.name, slug=payload.slug, admin=admin, actor=principal.token
    )
    return Status(201, team.to_dict())


@router.get(
    "/teams/{slug}/members",
    auth=read_auth(),
    response={200: Page[MembershipOut], **READ_ERRORS},
    summary="List a team's members and their roles",
)
def list_members(request: HttpRequest, slug: str, params: Query[PageParams]) -> dict:
    principal = principal_of(request)
    team = get_team(principal, slug)
    return page(
        memberships(principal).filter(team=team).order_by("user__username"), params
    )


@router.put(
    "/teams/{slug}/members/{username}",
    auth=token_auth("admin"),
    response={200: MembershipOut, **WRITE_ERRORS},
    summary="Add a user to the team, or set a member's role (admin role)",
    description="Idempotent. The last admin of a team can't step down (409).",
)
def set_member(
    request: HttpRequest, slug: str, username: str, payload: MembershipIn
) -> dict:
    principal = principal_of(request)
    team = get_team(principal, slug)
    user_model = get_user_model()
    user = get_object_or_404(user_model, **{user_model.USERNAME_FIELD: username})
    membership = do_add_member(team, user, payload.role, actor=principal.token)
    return membership.to_dict()


@router.delete(
    "/teams/{slug}/members/{username}",
    auth=token_auth("admin"),
    response={204: None, **WRITE_ERRORS},
    summary="Remove a member from the team (admin role); revokes their team tokens",
    description="The last admin of a team can't be removed (409).",
)
def remove_member(request: HttpRequest, slug: str, username: str) -> Status:
    principal = principal_of(request)
    team = get_team(principal, slug)
    membership = get_object_or_404(
        memberships(principal).filter(team=team), user__username=username
    )
    do_remove_member(team, membership.user, actor=principal.token)
    return Status(204, None)


@router.post(
    "/users",
    auth=token_auth("admin"),
    response={201: UserCreatedOut, **WRITE_ERRORS},
    summary="Create an account, a member of the token's team (admin role)",
    description="The account has no password: hand the person `set_password_url`, "
    "a one-time link where they choose one and can then sign in to the dashboard "
    "and make their own API tokens (Tokens page). A username that exists "
    "(compared case-insensitively) is a 409; add an existing user with PUT "
    "/teams/{slug}/members/{username}.",
)
def create_user(request: HttpRequest, payload: UserIn) -> Status:
    principal = principal_of(request)
    team = teams(principal).filter(slug=payload.team).first()
    if team is None:
        raise ValidationFailed(f"no team {payload.team!r} of yours", field="team")
    user = do_create_user(
        payload.username,
        team=team,
        role=payload.role,
        email=payload.email,
        actor=principal.token,
    )
    body = {
        "team": team.slug,
        "user": user.get_username(),
        "role": payload.role,
        "email": user.email,
        "set_password_url": set_password_url(request, user),
    }
    return Status(201, body)
