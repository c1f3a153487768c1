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

    def link(self, pk: int, *, seq: int, prev_hash: str, event_hash: str) -> int:
        """The one change an event ever gets: its place in the hash chain, given
        once, after its transaction committed (actions.chain_pending). Returns 1,
        or 0 if the event is gone or already chained."""
        unchained = self.filter(pk=pk, seq__isnull=True)
        return models.QuerySet.update(
            unchained, seq=seq, prev_hash=prev_hash, event_hash=event_hash
        )


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
    # The hash chain (chain.py): the event's position in it, the previous event's
    # hash, and this one's over its content and prev_hash. Empty (seq NULL) until
    # the event's transaction commits; then chain_pending sets them, under the chain
    # head's lock, in the order events committed.
    seq = models.BigIntegerField(null=True, blank=True, unique=True)
    prev_hash = models.CharField(max_length=64, blank=True)
    event_hash = models.CharField(max_length=64, blank=True)

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
            "seq": self.seq,
            "prev_hash": self.prev_hash,
            "hash": self.event_hash,
        }


class AuditChainHead(models.Model):
    """The one row that names the newest chained audit event, its position and its
    hash. The chainer (chain_pending) locks it (select_for_update) to append, so
    chainers take turns, and a chain that stops short of it shows its newest events
    were removed. Writers of events never touch it."""

    last_event_id = models.BigIntegerField(null=True, blank=True)
    last_seq = models.BigIntegerField(default=0)
    last_hash = models.CharField(max_length=64, blank=True)

    def __str__(self) -> str:
        return f"audit chain head at event {self.last_event_id}"


class EventWindow(models.Model):
    """An open window of events of one verb from one source for one reason, kept
    where events may come in floods (refused agent messages: anyone who reaches
    the broker can send them). The first is an AuditEvent in full
    (`first_event`); the rest only add to `count` here; once the window has
    passed, one AuditEvent (`summary_verb`) records the count and the row goes.
    The log so grows by at most two events a window per source and reason,
    however many come. Written only by audit.actions (do_record_bounded_event,
    do_close_event_windows). Not chained itself: its count is, through the
    summary event."""

    verb = models.CharField(max_length=100)
    summary_verb = models.CharField(max_length=100)
    source = models.CharField(max_length=200)
    reason = models.CharField(max_length=200)
    window_start = models.DateTimeField(db_index=True)
    window_s = models.FloatField()
    count = models.PositiveBigIntegerField(default=1)
    last_seen = models.DateTimeField(default=timezone.now)
    first_event = models.ForeignKey(
        AuditEvent, models.PROTECT, null=True, blank=True, related_name="+"
    )

    class Meta:
        ordering = ["window_start", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["verb", "source", "reason", "window_start"],
                name="unique_event_window",
            )
        ]

    def __str__(self) -> str:
        return f"{self.verb} from {self.source} ({self.reason}): {self.count}"

    def to_dict(self) -> dict:
        return {
            "verb": self.verb,
            "source": self.source,
            "reason": self.reason,
            "window_start": self.window_start.isoformat(),
            "window_s": self.window_s,
            "count": self.count,
            "last_seen": self.last_seen.isoformat(),
            "first_event": self.first_event_id,
        }
