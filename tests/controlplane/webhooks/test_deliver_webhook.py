import json
import time

import pytest

from controlplane import celery_app
from controlplane.errors import ValidationFailed
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.webhooks.actions import (
    check_webhook_url,
    do_create_webhook,
    retry_delay_s,
)
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


def named_webhook(environment, owner, receiver):
    """A webhook at a name the `resolver` answers for, on the receiver's port."""
    url = f"http://hooks.example.test:{receiver.port}/hooks/releasegate"
    return do_create_webhook(environment, url, actor=owner)


@pytest.mark.parametrize(
    "name, on_the_wire",
    [
        ("hooks.example.test", "hooks.example.test"),
        ("bücher.example.test", "xn--bcher-kva.example.test"),  # IDNA
    ],
)
def test_it_connects_to_the_address_it_resolved_and_keeps_the_host_name(
    release,
    environment,
    owner,
    receiver,
    queued,
    resolver,
    connects,
    settings,
    name,
    on_the_wire,
):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver is local
    url = f"http://{name}:{receiver.port}/hooks/releasegate"
    do_create_webhook(environment, url, actor=owner)
    resolver.answers = [["127.0.0.1"]]
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    assert deliver_webhook(delivery_id) == "delivered"

    assert len(resolver.lookups) == 1  # once
    assert connects == [("127.0.0.1", receiver.port)]
    [(headers, _)] = receiver.requests
    assert headers["Host"] == f"{on_the_wire}:{receiver.port}"


def test_it_never_connects_to_a_rebound_address(
    release, environment, owner, receiver, queued, resolver, connects, settings
):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = False
    named_webhook(environment, owner, receiver)
    # DNS rebinding: public for the check, the receiver's loopback address after.
    resolver.answers = [["8.8.8.8"], ["127.0.0.1"]] * 5
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    deliver_webhook(delivery_id)

    assert receiver.requests == []
    assert resolver.lookups == ["hooks.example.test"]
    assert connects == [("8.8.8.8", receiver.port)]
    delivery = WebhookDelivery.objects.get(pk=delivery_id)
    assert delivery.state == "pending"
    assert "ConnectError" in delivery.last_error


@pytest.mark.parametrize(
    "answer, named",
    [
        (["8.8.8.8", "127.0.0.1"], "private address 127.0.0.1"),
        (
            ["64:ff9b::7f00:1"],
            "address 64:ff9b::7f00:1, which embeds private address 127.0.0.1",
        ),
        (["::ffff:10.0.0.1"], "private address ::ffff:a00:1"),
    ],
)
def test_it_refuses_a_name_with_any_private_address(
    release,
    environment,
    owner,
    receiver,
    queued,
    resolver,
    connects,
    settings,
    answer,
    named,
):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = False
    named_webhook(environment, owner, receiver)
    resolver.answers = [answer]
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    deliver_webhook(delivery_id)

    assert connects == [] and receiver.requests == []
    delivery = WebhookDelivery.objects.get(pk=delivery_id)
    assert f"hooks.example.test resolves to {named}" in delivery.last_error


def test_it_ignores_proxy_variables(
    release, owner, webhook, receiver, proxy, queued, monkeypatch
):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv(name.lower(), f"http://127.0.0.1:{proxy.port}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    assert deliver_webhook(delivery_id) == "delivered"

    assert proxy.requests == []
    assert len(receiver.requests) == 1


@pytest.mark.parametrize("certified", ["hooks.example.test", "other.example.test"])
def test_it_checks_the_certificate_of_the_host_name(
    release, environment, owner, tls_receiver, queued, resolver, settings, certified
):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver is local
    receiver = tls_receiver(certified)
    url = f"https://hooks.example.test:{receiver.port}/hooks/releasegate"
    do_create_webhook(environment, url, actor=owner)
    resolver.answers = [["127.0.0.1"]]
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    state = deliver_webhook(delivery_id)

    assert receiver.server_names == ["hooks.example.test"]  # SNI: the name
    if certified == "hooks.example.test":
        assert state == "delivered"
        [(headers, _)] = receiver.requests
        assert headers["Host"] == f"hooks.example.test:{receiver.port}"
    else:
        assert receiver.requests == []
        error = WebhookDelivery.objects.get(pk=delivery_id).last_error
        assert "CERTIFICATE_VERIFY_FAILED" in error


def test_it_tries_the_next_checked_address_when_one_does_not_connect(
    release, environment, owner, receiver, queued, resolver, connects, settings
):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver is local
    named_webhook(environment, owner, receiver)
    resolver.answers = [["8.8.8.8", "127.0.0.1"]]
    do_transition_release(release, "verifying", actor=owner)
    [(delivery_id,)] = queued("deliver")

    assert deliver_webhook(delivery_id) == "delivered"

    assert connects == [("8.8.8.8", receiver.port), ("127.0.0.1", receiver.port)]
    assert resolver.lookups == ["hooks.example.test"]
