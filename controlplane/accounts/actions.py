import os
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from controlplane.accounts.models import API_SCOPES, ROLES, ApiToken, Membership, Team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import Conflict, Forbidden, ValidationFailed


def membership_for(user, team: Team) -> Membership | None:
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    return Membership.objects.filter(team=team, user=user).first()


def user_of(actor: Actor):
    """The person behind an actor: a token acts for its user."""
    if isinstance(actor, ApiToken):
        return actor.user
    if isinstance(actor, AbstractBaseUser):
        return actor
    return None


def check_actor_in_team(
    actor: Actor, team: Team, *, scope: str | None = None, roles=ROLES
) -> Membership:
    """Raise Forbidden unless the actor is a member of `team` with one of `roles` and,
    for a token, the token belongs to `team`, is active and carries `scope`."""
    if isinstance(actor, ApiToken):
        if not actor.is_active:
            raise Forbidden("this API token is revoked")
        if actor.team_id != team.id:
            raise Forbidden("this API token belongs to another team")
        if scope and scope not in actor.scopes:
            raise Forbidden(f"this API token lacks the {scope!r} scope")
    membership = membership_for(user_of(actor), team)
    if membership is None:
        raise Forbidden(f"not a member of team {team.slug}")
    if membership.role not in roles:
        raise Forbidden(
            f"needs role {' or '.join(roles)} in team {team.slug}, "
            f"has {membership.role}"
        )
    return membership


def do_create_team(name: str, *, actor: Actor = None, slug: str = "") -> Team:
    slug = slug or slugify(name)
    if not slug:
        raise ValidationFailed("team name must contain letters or digits", field="name")
    try:
        with transaction.atomic():
            team = Team.objects.create(name=name, slug=slug)
            do_record_event(
                actor, "team.created", team, after=team.to_dict(), team=team
            )
    except IntegrityError as exc:
        raise Conflict(f"team {slug!r} already exists", field="slug") from exc
    return team


def do_add_member(team: Team, user, role: str, *, actor: Actor = None) -> Membership:
    if role not in ROLES:
        raise ValidationFailed(
            f"role must be one of {', '.join(ROLES)}, got {role!r}", field="role"
        )
    with transaction.atomic():
        membership, created = Membership.objects.select_for_update().get_or_create(
            team=team, user=user, defaults={"role": role}
        )
        before = {} if created else {"role": membership.role}
        if membership.role != role:
            membership.role = role
            membership.save(update_fields=["role"])
        do_record_event(
            actor,
            "team.member_set",
            membership,
            before=before,
            after=membership.to_dict(),
            team=team,
        )
    return membership


def do_create_api_token(
    user, team: Team, name: str, scopes: list[str], *, actor: Actor = None
) -> tuple[ApiToken, str]:
    """Create a token for a member of `team`; returns (token, plaintext)."""
    unknown = sorted(set(scopes) - set(API_SCOPES))
    if unknown:
        raise ValidationFailed(f"unknown scopes: {', '.join(unknown)}", field="scopes")
    if membership_for(user, team) is None:
        raise Forbidden(f"{user.get_username()} is not a member of team {team.slug}")
    with transaction.atomic():
        token, plaintext = ApiToken.create(user, team, name, scopes)
        do_record_event(
            actor, "api_token.created", token, after=token.to_dict(), team=team
        )
    return token, plaintext


def do_revoke_api_token(token: ApiToken, *, actor: Actor = None) -> ApiToken:
    with transaction.atomic():
        token = ApiToken.objects.select_for_update().get(pk=token.pk)
        if token.revoked is None:
            token.revoked = timezone.now()
            token.save(update_fields=["revoked"])
            do_record_event(
                actor,
                "api_token.revoked",
                token,
                before={"revoked": None},
                after={"revoked": token.revoked.isoformat()},
                team=token.team,
            )
    return token


def do_touch_api_token(token: ApiToken) -> None:
    # Not audited: last_used is bookkeeping, written on every authenticated request.
    now = timezone.now()
    ApiToken.objects.filter(pk=token.pk).update(last_used=now)
    token.last_used = now


def _inside_host_roots(path: PurePosixPath) -> bool:
    return any(
        path == root or root in path.parents
        for root in map(PurePosixPath, settings.RELEASEGATE_SOURCE_ROOTS)
    )


def check_source_roots(roots: list[str]) -> list[str]:
    """`roots` normalised; ValidationFailed unless each is an absolute path without
    '..' inside one of settings.RELEASEGATE_SOURCE_ROOTS (the host's boundary)."""
    checked = []
    for root in roots:
        if not isinstance(root, str) or not root.startswith("/") or "\x00" in root:
            raise ValidationFailed(
                f"source root {root!r} must be an absolute path", field="source_roots"
            )
        if ".." in root.split("/"):
            raise ValidationFailed(
                f"source root {root!r} must not contain '..'", field="source_roots"
            )
        path = PurePosixPath(os.path.normpath(root))
        if not _inside_host_roots(path):
            host = ", ".join(str(r) for r in settings.RELEASEGATE_SOURCE_ROOTS)
            raise ValidationFailed(
                f"source root {path} is outside this host's source roots ({host})",
                field="source_roots",
            )
        checked.append(str(path))
    return checked


def team_source_roots(team: Team) -> list[Path]:
    """The folders `team`'s release sources may come from now: its roots that are
    still inside the host's (settings may have narrowed since they were set)."""
    return [
        root
        for root in team.allowed_source_roots
        if _inside_host_roots(PurePosixPath(os.path.normpath(root)))
    ]


def do_set_team_source_roots(team: Team, roots: list[str], *, actor: Actor) -> Team:
    """Confine `team`'s release sources to `roots` (empty: the default,
    <host root>/<slug>). For the site's operator: a team could otherwise point
    itself at another team's folders."""
    checked = check_source_roots(roots)
    with transaction.atomic():
        team = Team.objects.select_for_update().get(pk=team.pk)
        before = {"source_roots": team.source_roots}
        team.source_roots = checked
        team.save(update_fields=["source_roots"])
        do_record_event(
            actor,
            "team.source_roots_set",
            team,
            before=before,
            after={"source_roots": checked},
            team=team,
        )
    return team
