from urllib.parse import urlsplit

from django.db import models
from django.utils import timezone

DELIVERY_STATES = ("pending", "delivered", "failed")


def _iso(value):
    return value.isoformat() if value else None


class Webhook(models.Model):
    """A URL that hears about every state change of the releases targeting
    `environment`. The signing secret is stored encrypted (actions.py) and never
    shown after creation."""

    environment = models.ForeignKey(
        "fleet.Environment", models.CASCADE, related_name="webhooks"
    )
    url = models.URLField(max_length=500)
    secret_ciphertext = models.TextField()
    active = models.BooleanField(default=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created", "id"]

    def __str__(self) -> str:
        return f"{self.url} ({self.environment})"

    @property
    def url_shown(self) -> str:
        """Scheme and host only: a path or query may itself be a credential (many
        receivers put a token there)."""
        parts = urlsplit(self.url)
        rest = "/…" if (parts.path not in ("", "/") or parts.query) else "/"
        return f"{parts.scheme}://{parts.netloc}{rest}"

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "environment": self.environment.name,
            "url": self.url_shown,
            "active": self.active,
            "created": _iso(self.created),
        }


class WebhookDelivery(models.Model):
    STATE_CHOICES = [(s, s) for s in DELIVERY_STATES]

    webhook = models.ForeignKey(Webhook, models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=100)
    payload = models.JSONField()
    state = models.CharField(max_length=20, choices=STATE_CHOICES, default="pending")
    attempts = models.PositiveIntegerField(default=0)
    last_status = models.IntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created = models.DateTimeField(default=timezone.now)
    delivered = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created", "id"]
        verbose_name_plural = "webhook deliveries"

    def __str__(self) -> str:
        return f"{self.event} to {self.webhook.url} ({self.state})"

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "webhook_id": self.webhook_id,
            "event": self.event,
            "state": self.state,
            "attempts": self.attempts,
            "last_status": self.last_status,
            "last_error": self.last_error,
            "created": _iso(self.created),
            "delivered": _iso(self.delivered),
        }
