import hashlib
import hmac
import secrets
from pathlib import Path

from django.conf import settings
from django.db import models
from django.utils import timezone

ROLES = ("member", "approver", "admin")
# The roles that may approve, reject and roll back (API, dashboard and actions alike).
APPROVER_ROLES = ("approver", "admin")
# admin: change an environment's gate policy and webhooks, manage the team's members,
# environments and tokens (also needs the admin role).
API_SCOPES = ("read", "register", "promote", "approve", "admin")
# The scopes a token of a member with each role may carry (least privilege: a token
# never holds more than its user could do): approve needs the approver or admin
# role, admin the admin role.
ROLE_SCOPES = {
    "member": ("read", "register", "promote"),
    "approver": ("read", "register", "promote", "approve"),
    "admin": API_SCOPES,
}
TOKEN_PREFIX_LENGTH = 8


def hash_token(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


class Team(models.Model):
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=100, unique=True)
    # Absolute folders the team's release sources must lie in, each inside one of
    # settings.RELEASEGATE_SOURCE_ROOTS; set by an operator (Django admin), never by
    # the team itself. Empty: <root>/<slug> for each of those roots.
    source_roots = models.JSONField(default=list, blank=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def allowed_source_roots(self) -> list[Path]:
        if self.source_roots:
            return [Path(p) for p in self.source_roots]
        return [Path(root) / self.slug for root in settings.RELEASEGATE_SOURCE_ROOTS]

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "slug": self.slug}


class Membership(models.Model):
    ROLE_CHOICES = [(r, r) for r in ROLES]

    team = models.ForeignKey(Team, models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=20, choices=ROLE_CHOICES, default="member")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "user"], name="unique_membership"),
            models.CheckConstraint(
                condition=models.Q(role__in=ROLES), name="membership_role_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"

    @property
    def can_approve(self) -> bool:
        return self.role in APPROVER_ROLES

    def to_dict(self) -> dict:
        return {"team": self.team.slug, "user": self.user.username, "role": self.role}


class ApiTokenQuerySet(models.QuerySet):
    def visible_to(self, user, team_ids=None):
        """The tokens `user` may see and revoke: their own, and every token of a
        team they are an admin of; only in `team_ids` when given (an API token
        sees its own team only)."""
        if user is None or not user.is_authenticated:
            return self.none()
        memberships = Membership.objects.filter(user=user)
        if team_ids is not None:
            memberships = memberships.filter(team_id__in=team_ids)
        admin_of = memberships.filter(role="admin").values("team_id")
        return self.filter(team_id__in=memberships.values("team_id")).filter(
            models.Q(user=user) | models.Q(team_id__in=admin_of)
        )


class ApiToken(models.Model):
    """A per-client API credential. Only the sha256 of the token is stored; the
    plaintext is shown once, at creation. `prefix` identifies a token in listings."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, models.CASCADE, related_name="api_tokens"
    )
    team = models.ForeignKey(Team, models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=TOKEN_PREFIX_LENGTH, db_index=True)
    token_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created = models.DateTimeField(default=timezone.now)
    last_used = models.DateTimeField(null=True, blank=True)
    revoked = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_active(self) -> bool:
        return self.revoked is None

    def has_scope(self, scope: str) -> bool:
        return self.is_active and scope in self.scopes

    @classmethod
    def create(cls, user, team: Team, name: str, scopes: list[str]):
        """Return (token, plaintext). The plaintext is never stored."""
        unknown = sorted(set(scopes) - set(API_SCOPES))
        if unknown:
            raise ValueError(f"unknown scopes: {', '.join(unknown)}")
        plaintext = "rg_" + secrets.token_urlsafe(32)
        token = cls.objects.create(
            user=user,
            team=team,
            name=name,
            prefix=plaintext[:TOKEN_PREFIX_LENGTH],
            token_hash=hash_token(plaintext),
            scopes=sorted(set(scopes), key=API_SCOPES.index),
        )
        return token, plaintext

    @classmethod
    def lookup(cls, plaintext: str) -> "ApiToken | None":
        """The active token for `plaintext`, or None. Candidates are found by the
        non-secret prefix; the hash comparison is constant-time."""
        if not plaintext:
            return None
        wanted = hash_token(plaintext)
        candidates = cls.objects.filter(
            prefix=plaintext[:TOKEN_PREFIX_LENGTH], revoked__isnull=True
        ).select_related("user", "team")
        for token in candidates:
            if hmac.compare_digest(token.token_hash, wanted):
                return token if token.user.is_active else None
        return None

    @property
    def actor_name(self) -> str:
        return f"token:{self.prefix} ({self.name}, {self.user.username})"

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "prefix": self.prefix,
            "team": self.team.slug,
            "user": self.user.username,
            "scopes": list(self.scopes),
            "created": self.created.isoformat(),
            "last_used": self.last_used.isoformat() if self.last_used else None,
            "revoked": self.revoked.isoformat() if self.revoked else None,
        }
