import os
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.core.validators import EmailValidator
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from controlplane.accounts.models import (
    API_SCOPES,
    ROLE_SCOPES,
    ROLES,
    ApiToken,
    Membership,
    Team,
)
from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import Conflict, Forbidden, NotFound, ValidationFailed

TEAM_NAME_MAX_LENGTH = 100
TOKEN_NAME_MAX_LENGTH = 100
USERNAME_MAX_LENGTH = 150


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


def is_system(actor: Actor) -> bool:
    """A named system component or the CLI ("system:cli"), not a person: what it
    may do was decided by whoever could run it (a shell on the server)."""
    return actor is None or isinstance(actor, str)


def check_manage_team(actor: Actor, team: Team) -> None:
    """Raise Forbidden unless `actor` may administer `team` (its members, users,
    environments and tokens): the admin role in the team and, for a token, one of
    the team's with the admin scope. A superuser signed in (the admin site, the
    dashboard) may too; a superuser's token is bound to its team like any other."""
    user = user_of(actor)
    if (
        not isinstance(actor, ApiToken)
        and user is not None
        and user.is_active
        and user.is_superuser
    ):
        return
    check_actor_in_team(actor, team, scope="admin", roles=("admin",))


def check_create_team(actor: Actor) -> None:
    """Teams are created by the site's operators: a staff account (is_staff, as
    for the admin site) or a superuser; through the API with an admin-scope token
    of such an account. A team admin manages their own team, never makes another."""
    if is_system(actor):
        return
    if isinstance(actor, ApiToken) and "admin" not in actor.scopes:
        raise Forbidden("this API token lacks the 'admin' scope")
    user = user_of(actor)
    if user is None or not user.is_active or not (user.is_staff or user.is_superuser):
        raise Forbidden(
            "creating a team needs a staff or superuser account; ask the site's "
            "operator"
        )


def _record_member_set(membership: Membership, before: dict, actor: Actor) -> None:
    do_record_event(
        actor,
        "team.member_set",
        membership,
        before=before,
        after=membership.to_dict(),
        team=membership.team,
    )


def do_create_team(
    name: str, *, actor: Actor = None, slug: str = "", admin=None
) -> Team:
    """Create a team (staff or superuser: check_create_team); `admin`, when
    given, is its first member, with the admin role, so someone can manage it."""
    check_create_team(actor)
    name = name.strip()
    if not name or len(name) > TEAM_NAME_MAX_LENGTH:
        raise ValidationFailed(
            f"team name must be 1 to {TEAM_NAME_MAX_LENGTH} characters", field="name"
        )
    if slug and (slug != slugify(slug) or len(slug) > TEAM_NAME_MAX_LENGTH):
        raise ValidationFailed(
            f"slug {slug!r} must be lowercase letters, digits, - and _ "
            f"(at most {TEAM_NAME_MAX_LENGTH})",
            field="slug",
        )
    slug = slug or slugify(name)[:TEAM_NAME_MAX_LENGTH]
    if not slug:
        raise ValidationFailed("team name must contain letters or digits", field="name")
    try:
        with transaction.atomic():
            team = Team.objects.create(name=name, slug=slug)
            do_record_event(
                actor, "team.created", team, after=team.to_dict(), team=team
            )
            if admin is not None:
                membership = Membership.objects.create(
                    team=team, user=admin, role="admin"
                )
                _record_member_set(membership, {}, actor)
    except IntegrityError as exc:
        raise Conflict(f"team {slug!r} already exists", field="slug") from exc
    return team


def check_keeps_an_admin(membership: Membership, new_role: str | None) -> None:
    """Conflict if this change leaves the team without an admin (then nobody but a
    superuser could manage it)."""
    if membership.role != "admin" or new_role == "admin":
        return
    others = Membership.objects.filter(team=membership.team, role="admin").exclude(
        pk=membership.pk
    )
    if not others.exists():
        raise Conflict(
            f"{membership.user.get_username()} is the only admin of team "
            f"{membership.team.slug}; make someone else admin first",
            field="role",
        )


def do_add_member(team: Team, user, role: str, *, actor: Actor = None) -> Membership:
    """Add `user` to `team` with `role`, or set the role of a member (team admins;
    the last admin can't step down)."""
    if not is_system(actor):
        check_manage_team(actor, team)
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
            check_keeps_an_admin(membership, role)
            membership.role = role
            membership.save(update_fields=["role"])
        _record_member_set(membership, before, actor)
    return membership


def do_remove_member(team: Team, user, *, actor: Actor = None) -> None:
    """Take `user` out of `team` (team admins; not the last admin). Their tokens
    of the team are revoked with it: they stop working at once, and would not
    come back should the user be added again."""
    if not is_system(actor):
        check_manage_team(actor, team)
    with transaction.atomic():
        membership = (
            Membership.objects.select_for_update().filter(team=team, user=user).first()
        )
        if membership is None:
            raise NotFound(f"{user.get_username()} is not a member of {team.slug}")
        check_keeps_an_admin(membership, None)
        for token in ApiToken.objects.filter(team=team, user=user, revoked=None):
            do_revoke_api_token(token, actor=actor)
        do_record_event(
            actor,
            "team.member_removed",
            membership,
            before=membership.to_dict(),
            team=team,
        )
        membership.delete()


def check_new_username(username: str) -> str:
    """`username` as a new account's, or ValidationFailed/Conflict naming why."""
    user_model = get_user_model()
    if not username or len(username) > USERNAME_MAX_LENGTH:
        raise ValidationFailed(
            f"username must be 1 to {USERNAME_MAX_LENGTH} characters",
            field="username",
        )
    try:
        user_model.username_validator(username)
    except ValidationError as exc:
        raise ValidationFailed(
            f"username {username!r}: {' '.join(exc.messages)}", field="username"
        ) from exc
    # Case-insensitively: "Alice" beside "alice" is a mistake waiting to happen.
    taken = user_model.objects.filter(
        **{f"{user_model.USERNAME_FIELD}__iexact": username}
    )
    if taken.exists():
        raise Conflict(f"username {username!r} is taken", field="username")
    return username


def do_create_user(
    username: str, *, team: Team, role: str, email: str = "", actor: Actor = None
):
    """A new account, a member of `team` with `role` (created by the team's
    admins). It has no usable password: the person sets one through a one-time
    link (Django's password reset token; api/teams.py builds it)."""
    if not is_system(actor):
        check_manage_team(actor, team)
    check_new_username(username)
    if role not in ROLES:
        raise ValidationFailed(
            f"role must be one of {', '.join(ROLES)}, got {role!r}", field="role"
        )
    if email:
        try:
            EmailValidator()(email)
        except ValidationError as exc:
            raise ValidationFailed(
                f"email {email!r} is not valid", field="email"
            ) from exc
    with transaction.atomic():
        user = get_user_model().objects.create_user(username, email=email)
        do_record_event(
            actor,
            "user.created",
            user,
            after={"username": username, "email": email},
            team=team,
        )
        membership = Membership.objects.create(team=team, user=user, role=role)
        _record_member_set(membership, {}, actor)
    return user


def roles_with_scope(scope: str) -> tuple[str, ...]:
    return tuple(role for role in ROLES if scope in ROLE_SCOPES[role])


def check_create_api_token(
    user, team: Team, name: str, scopes: list[str], *, actor: Actor
) -> None:
    """A token for `user` in `team` named `name` with `scopes`: every scope known
    and allowed by the user's role there (least privilege); made by the user
    themselves or by a team admin; a token making one can't grant more than it
    holds."""
    unknown = sorted(set(scopes) - set(API_SCOPES))
    if unknown:
        raise ValidationFailed(f"unknown scopes: {', '.join(unknown)}", field="scopes")
    if not scopes:
        raise ValidationFailed(
            f"a token needs at least one scope of {', '.join(API_SCOPES)}",
            field="scopes",
        )
    if not name.strip() or len(name) > TOKEN_NAME_MAX_LENGTH:
        raise ValidationFailed(
            f"token name must be 1 to {TOKEN_NAME_MAX_LENGTH} characters", field="name"
        )
    membership = membership_for(user, team)
    if membership is None:
        raise Forbidden(f"{user.get_username()} is not a member of team {team.slug}")
    for scope in scopes:
        if scope not in ROLE_SCOPES[membership.role]:
            raise Forbidden(
                f"the {scope!r} scope needs the {' or '.join(roles_with_scope(scope))}"
                f" role in team {team.slug}; {user.get_username()} is "
                f"{membership.role}",
                field="scopes",
            )
    if is_system(actor):
        return
    if isinstance(actor, ApiToken):
        check_actor_in_team(actor, team)
        beyond = [s for s in scopes if s not in actor.scopes]
        if beyond:
            raise Forbidden(
                f"this API token can't grant scopes it lacks: {', '.join(beyond)}",
                field="scopes",
            )
    if user_of(actor) != user:
        check_manage_team(actor, team)


def do_create_api_token(
    user, team: Team, name: str, scopes: list[str], *, actor: Actor = None
) -> tuple[ApiToken, str]:
    """Create a token for a member of `team` (check_create_api_token); returns
    (token, plaintext): the plaintext is never stored, show it once."""
    check_create_api_token(user, team, name, scopes, actor=actor)
    with transaction.atomic():
        token, plaintext = ApiToken.create(user, team, name, scopes)
        do_record_event(
            actor, "api_token.created", token, after=token.to_dict(), team=team
        )
    return token, plaintext


def check_revoke_api_token(token: ApiToken, actor: Actor) -> None:
    """Its user may revoke a token (a token of theirs in the same team, through
    the API), and so may the team's admins."""
    if isinstance(actor, ApiToken) and actor.team_id != token.team_id:
        raise Forbidden("this API token belongs to another team")
    if user_of(actor) != token.user:
        check_manage_team(actor, token.team)


def do_revoke_api_token(token: ApiToken, *, actor: Actor = None) -> ApiToken:
    """Revoke `token` (its user or a team admin: check_revoke_api_token);
    idempotent, audited once."""
    if not is_system(actor):
        check_revoke_api_token(token, actor)
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
