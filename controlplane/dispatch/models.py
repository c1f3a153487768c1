from django.db import models
from django.utils import timezone


def _iso(value):
    return value.isoformat() if value else None


class OutboxMessage(models.Model):
    """A Celery task to send once the transaction that added it commits.

    Written only by controlplane.dispatch.actions. `sent` is set when the broker took
    it; until then `next_attempt` says when the relay tries again (a failed attempt
    pushes it back). A message may reach the broker twice (sent, then the worker
    died before marking it): the tasks it names are idempotent."""

    task = models.CharField(max_length=200)
    args = models.JSONField(default=list, blank=True)
    queue = models.CharField(max_length=200, blank=True)
    created = models.DateTimeField(default=timezone.now)
    next_attempt = models.DateTimeField(default=timezone.now)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    sent = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created", "id"]
        indexes = [models.Index(fields=["sent", "next_attempt"])]

    def __str__(self) -> str:
        return f"{self.task}{tuple(self.args)}"

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "task": self.task,
            "args": self.args,
            "queue": self.queue,
            "created": _iso(self.created),
            "attempts": self.attempts,
            "next_attempt": _iso(self.next_attempt),
            "last_error": self.last_error,
            "sent": _iso(self.sent),
        }
