from django.conf import settings
from django.db import models
from django.utils import timezone


class AppendOnlyError(Exception):
    """Audit events are written once and never changed or removed."""


class AuditEventQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AppendOnlyError("audit events cannot be updated")

    def delete(self):
        raise AppendOnlyError("audit events cannot be deleted")


class AuditEvent(models.Model):
    # PROTECT: an actor with history is deactivated, not deleted, so no row changes.
    team = models.ForeignKey(
        "accounts.Team", models.PROTECT, null=True, blank=True, related_name="+"
    )
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        models.PROTECT,
        null=True,
        blank=True,
        related_name="+",
    )
    actor_token = models.ForeignKey(
        "accounts.ApiToken", models.PROTECT, null=True, blank=True, related_name="+"
    )
    actor_name = models.CharField(max_length=200)
    verb = models.CharField(max_length=100, db_index=True)
    object_type = models.CharField(max_length=50)
    object_id = models.CharField(max_length=50)
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)
    created = models.DateTimeField(default=timezone.now, db_index=True)
    # The hash chain (chain.py): the previous event's hash, and this one's over its
    # content and prev_hash. Set by do_record_event, under the chain head's lock.
    prev_hash = models.CharField(max_length=64)
    event_hash = models.CharField(max_length=64)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        ordering = ["-created", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"])]

    def __str__(self) -> str:
        return f"{self.actor_name} {self.verb} {self.object_type}:{self.object_id}"

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyError("audit events cannot be updated")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError("audit events cannot be deleted")

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "team": self.team.slug if self.team_id else None,
            "actor": self.actor_name,
            "verb": self.verb,
            "object_type": self.object_type,
            "object_id": self.object_id,
            "before": self.before,
            "after": self.after,
            "created": self.created.isoformat(),
            "prev_hash": self.prev_hash,
            "hash": self.event_hash,
        }


class AuditChainHead(models.Model):
    """The one row that names the newest audit event and its hash. Writers lock it
    (select_for_update) to append, so events chain in the order they commit, and
    a chain that stops short of it shows its newest events were removed."""

    last_event_id = models.BigIntegerField(null=True, blank=True)
    last_hash = models.CharField(max_length=64, blank=True)

    def __str__(self) -> str:
        return f"audit chain head at event {self.last_event_id}"
