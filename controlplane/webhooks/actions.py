"""Every write to webhooks and their deliveries.

Secrets: generated here (shown once, like API tokens) and stored encrypted with a
key derived from RELEASEGATE_WEBHOOK_KEY (default: SECRET_KEY); they are decrypted
only to sign a delivery. Deliveries: `do_queue_release_event` adds one per active
webhook of the release's target environment in the caller's transaction and queues
its task through the outbox; `attempt_delivery` makes one signed POST and says
whether (and when) to try again, up to RELEASEGATE_WEBHOOK_MAX_ATTEMPTS."""

import base64
import ipaddress
import json
import secrets
import time
from urllib.parse import urlsplit

import httpx
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.accounts.actions import check_actor_in_team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.dispatch.actions import do_enqueue_task
from controlplane.errors import ValidationFailed
from controlplane.fleet.models import Environment
from controlplane.webhooks import addresses
from controlplane.webhooks.models import Webhook, WebhookDelivery
from controlplane.webhooks.signing import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    signature_header,
)

DELIVER_TASK = "controlplane.webhooks.deliver"
RELEASE_STATE_CHANGED = "release.state_changed"


def _fernet() -> Fernet:
    key = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=b"releasegate webhook secrets",
    ).derive(settings.RELEASEGATE_WEBHOOK_KEY.encode())
    return Fernet(base64.urlsafe_b64encode(key))


def decrypt_secret(webhook: Webhook) -> str:
    return _fernet().decrypt(webhook.secret_ciphertext.encode()).decode()


def check_webhook_url(url: str) -> str:
    """ValidationFailed unless `url` is an http(s) URL with a host (and, unless
    RELEASEGATE_WEBHOOK_ALLOW_PRIVATE, one that does not name a private,
    loopback or link-local address literally, nor an IPv6 form of one)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationFailed("url must be an http(s) URL with a host", field="url")
    if parts.username or parts.password:
        raise ValidationFailed("url must not carry credentials", field="url")
    try:
        address = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return url
    why = addresses.why_refused(address)
    if why and not settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE:
        raise ValidationFailed(f"url names {why}", field="url")
    return url


def post_pinned(url: str, *, content: bytes, headers: dict) -> httpx.Response:
    """POST to `url` over a connection to an address its host resolved to once and
    that was checked then (addresses.resolve_checked), trying the next address only
    when one does not connect. The Host header, TLS SNI and the certificate check
    keep the URL's host name. Proxy variables (HTTPS_PROXY...) are ignored: a
    proxy would resolve the name again, past the check. AddressRefused or
    httpx.HTTPError when nothing was delivered."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    found = addresses.resolve_checked(
        parts.hostname, port, allow_private=settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE
    )
    named = httpx.URL(url)  # the name as it goes on the wire (IDNA)
    headers = {**headers, "Host": named.netloc.decode("ascii")}
    extensions = {}
    if parts.scheme == "https" and not _is_address(parts.hostname):
        extensions["sni_hostname"] = named.raw_host.decode("ascii")
    *others, last = found
    with httpx.Client(
        trust_env=False,
        timeout=settings.RELEASEGATE_WEBHOOK_TIMEOUT_S,
        follow_redirects=False,
    ) as client:
        for address in others:
            try:
                return client.post(
                    _at(parts, address, port),
                    content=content,
                    headers=headers,
                    extensions=extensions,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout):
                continue  # the next checked address
        return client.post(
            _at(parts, last, port),
            content=content,
            headers=headers,
            extensions=extensions,
        )


def _at(parts, address, port: int) -> str:
    """The URL `parts` with its host replaced by `address`."""
    literal = f"[{address}]" if address.version == 6 else str(address)
    return parts._replace(netloc=f"{literal}:{port}").geturl()


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def do_create_webhook(
    environment: Environment, url: str, *, actor: Actor
) -> tuple[Webhook, str]:
    """Add a webhook (admin role; a token needs the admin scope). Returns it and
    its signing secret, which is shown this once."""
    check_actor_in_team(actor, environment.team, scope="admin", roles=("admin",))
    check_webhook_url(url)
    secret = "whsec_" + secrets.token_urlsafe(32)
    with transaction.atomic():
        webhook = Webhook.objects.create(
            environment=environment,
            url=url,
            secret_ciphertext=_fernet().encrypt(secret.encode()).decode(),
        )
        do_record_event(
            actor,
            "webhook.created",
            webhook,
            after=webhook.to_dict(),
            team=environment.team,
        )
    return webhook, secret


def do_delete_webhook(webhook: Webhook, *, actor: Actor) -> None:
    environment = webhook.environment
    check_actor_in_team(actor, environment.team, scope="admin", roles=("admin",))
    with transaction.atomic():
        do_record_event(
            actor,
            "webhook.deleted",
            webhook,
            before=webhook.to_dict(),
            team=environment.team,
        )
        webhook.delete()


def release_event_payload(release, from_state: str, to_state: str, reason: str):
    return {
        "event": RELEASE_STATE_CHANGED,
        "created": timezone.now().isoformat(),
        "release": {
            "id": release.pk,
            "team": release.model.team.slug,
            "model": release.model.name,
            "version": release.version,
            "target_environment": release.target_environment.name,
            "previous_state": from_state,
            "state": to_state,
            "reason": reason,
            "manifest_digest": release.manifest_digest,
        },
    }


def do_queue_release_event(release, from_state: str, to_state: str, reason: str):
    """One delivery per active webhook of the release's target environment, queued
    with the caller's transaction (call it inside the transition's)."""
    webhooks = Webhook.objects.filter(
        environment_id=release.target_environment_id, active=True
    )
    if not webhooks:
        return
    payload = release_event_payload(release, from_state, to_state, reason)
    for webhook in webhooks:
        delivery = WebhookDelivery.objects.create(
            webhook=webhook, event=RELEASE_STATE_CHANGED, payload=payload
        )
        do_enqueue_task(DELIVER_TASK, delivery.pk)


def delivery_body(delivery: WebhookDelivery) -> bytes:
    return json.dumps(delivery.payload, sort_keys=True, separators=(",", ":")).encode()


def retry_delay_s(attempts: int) -> float:
    """Wait after the `attempts`-th failed attempt: base x 4^(n-1), capped."""
    base = settings.RELEASEGATE_WEBHOOK_RETRY_BASE_S
    return min(base * 4 ** (attempts - 1), settings.RELEASEGATE_WEBHOOK_MAX_DELAY_S)


def attempt_delivery(delivery_id: int) -> tuple[str, float | None]:
    """One signed POST of a pending delivery; returns (state, seconds until the
    next attempt or None). 2xx delivers; anything else, or no answer, fails the
    attempt, and the delivery fails for good after RELEASEGATE_WEBHOOK_MAX_ATTEMPTS.
    A delivery no longer pending (a redelivered task) is left as it is."""
    with transaction.atomic():
        delivery = (
            WebhookDelivery.objects.select_for_update()
            .select_related("webhook")
            .filter(pk=delivery_id)
            .first()
        )
        if delivery is None or delivery.state != "pending":
            return (delivery.state if delivery else "missing"), None
        delivery.attempts += 1
        delivery.save(update_fields=["attempts"])
    webhook = delivery.webhook
    body = delivery_body(delivery)
    status, error = None, ""
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "releasegate-webhooks",
        EVENT_HEADER: delivery.event,
        DELIVERY_HEADER: str(delivery.pk),
        SIGNATURE_HEADER: signature_header(
            decrypt_secret(webhook), int(time.time()), body
        ),
    }
    try:
        status = post_pinned(webhook.url, content=body, headers=headers).status_code
        if not 200 <= status < 300:
            error = f"HTTP {status}"
    except addresses.AddressRefused as exc:
        error = str(exc)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if not error:
        state, retry_in = "delivered", None
    elif delivery.attempts >= settings.RELEASEGATE_WEBHOOK_MAX_ATTEMPTS:
        state, retry_in = "failed", None
    else:
        state, retry_in = "pending", retry_delay_s(delivery.attempts)
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        state=state,
        last_status=status,
        last_error=error[:2000],
        delivered=timezone.now() if state == "delivered" else None,
    )
    return state, retry_in
