import json
import time

import pytest

from controlplane import celery_app
from controlplane.errors import ValidationFailed
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.webhooks.actions import check_webhook_url, retry_delay_s
from controlplane.webhooks.models import Webhook, WebhookDelivery
from controlplane.webhooks.signing import verify_signature
from controlplane.webhooks.tasks import deliver_webhook


@pytest.fixture
def eager():
    """Retries run at once, in-process (their countdown is not waited for)."""
    saved = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = saved


def test_it_signs_every_release_state_change(release, owner, webhook, receiver, queued):
    _, secret = webhook

    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    assert deliver_webhook(delivery_id) == "delivered"

    [(headers, body)] = receiver.requests
    header = headers["X-Releasegate-Signature"]
    assert verify_signature(secret, header, body, now=time.time())
    payload = json.loads(body)
    assert payload["event"] == headers["X-Releasegate-Event"] == "release.state_changed"
    assert payload["release"]["id"] == release.pk
    assert (payload["release"]["previous_state"], payload["release"]["state"]) == (
        "registered",
        "verifying",
    )
    # What a receiver must refuse: other bytes, another secret, an old timestamp.
    assert not verify_signature(secret, header, body + b" ", now=time.time())
    assert not verify_signature("whsec_other", header, body, now=time.time())
    assert not verify_signature(secret, header, body, now=time.time() + 3600)
    delivery = WebhookDelivery.objects.get(pk=delivery_id)
    assert (delivery.state, delivery.attempts, delivery.last_status) == (
        "delivered",
        1,
        200,
    )


def test_it_retries_with_backoff_until_delivered(
    release, owner, webhook, receiver, queued, eager
):
    receiver.statuses = [500, 503]
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    deliver_webhook(delivery_id)

    delivery = WebhookDelivery.objects.get(pk=delivery_id)
    assert (delivery.state, delivery.attempts) == ("delivered", 3)
    assert len(receiver.requests) == 3
    assert len({body for _, body in receiver.requests}) == 1  # the same event
    assert retry_delay_s(1) < retry_delay_s(2) < retry_delay_s(3)


def test_it_gives_up_after_the_last_attempt(
    release, owner, webhook, receiver, queued, eager, settings
):
    settings.RELEASEGATE_WEBHOOK_MAX_ATTEMPTS = 3
    receiver.statuses = [500] * 10
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    deliver_webhook(delivery_id)

    delivery = WebhookDelivery.objects.get(pk=delivery_id)
    assert (delivery.state, delivery.attempts, delivery.last_error) == (
        "failed",
        3,
        "HTTP 500",
    )
    assert len(receiver.requests) == 3
    assert deliver_webhook(delivery_id) == "failed"  # a redelivery sends nothing
    assert len(receiver.requests) == 3


def test_it_sends_nothing_for_other_environments(
    make_release, make_environment, owner, webhook, queued
):
    elsewhere = make_release(target_environment=make_environment("prod"))

    do_transition_release(elsewhere, "verifying", actor=owner)

    assert queued("deliver") == []


def test_it_stores_the_secret_encrypted(webhook):
    stored, secret = webhook

    ciphertext = Webhook.objects.get(pk=stored.pk).secret_ciphertext
    assert secret not in ciphertext
    assert secret.removeprefix("whsec_") not in ciphertext


def test_it_refuses_private_addresses_unless_allowed(
    release, owner, webhook, receiver, queued, settings
):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(ValidationFailed, match="private address 127.0.0.1"):
        check_webhook_url(receiver.url)
    for bad in ("ftp://example.org/x", "http://user:pw@example.org/", "example"):
        with pytest.raises(ValidationFailed):
            check_webhook_url(bad)
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    deliver_webhook(delivery_id)  # the stored URL now resolves to a private address

    assert receiver.requests == []
    delivery = WebhookDelivery.objects.get(pk=delivery_id)
    assert "private address 127.0.0.1" in delivery.last_error
