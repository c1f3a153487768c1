import time

import pytest
from django.db import transaction

from controlplane.dispatch.actions import do_enqueue_task
from controlplane.dispatch.models import OutboxMessage
from tests.controlplane.dispatch.conftest import received

TASK = "controlplane.releases.run_promotion"


def test_it_commits_and_rolls_back_with_the_write(db):
    with pytest.raises(RuntimeError), transaction.atomic():
        do_enqueue_task(TASK, 1)
        raise RuntimeError("the write failed")

    assert not OutboxMessage.objects.exists()
    with transaction.atomic():
        do_enqueue_task(TASK, 2)
    assert [m.args for m in OutboxMessage.objects.all()] == [[2]]


def test_it_publishes_once_the_transaction_commits(
    db, working_broker, queue_name, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        message = do_enqueue_task(TASK, 7, queue=queue_name)
        assert received(queue_name) == []  # nothing leaves before the commit

    assert len(callbacks) == 1
    assert received(queue_name) == [(TASK, [7])]
    message.refresh_from_db()
    assert message.sent is not None
    assert (message.attempts, message.last_error) == (1, "")


def test_it_keeps_the_message_when_the_broker_is_down_and_answers_fast(
    db, broker_at, unreachable_broker_url, django_capture_on_commit_callbacks
):
    broker_at(unreachable_broker_url)
    started = time.monotonic()

    with django_capture_on_commit_callbacks(execute=True):
        message = do_enqueue_task(TASK, 7)

    # Bounded, not benchmarked: kombu's own reconnect loop took ~19 s here.
    assert time.monotonic() - started < 5
    message.refresh_from_db()
    assert message.sent is None
    assert message.attempts == 1
    assert "refused" in message.last_error.lower()
    assert message.next_attempt > message.created


def test_a_broker_that_accepts_and_never_answers_costs_the_publish_timeout(
    db, broker_at, silent_broker_url, settings, django_capture_on_commit_callbacks
):
    settings.RELEASEGATE_OUTBOX_PUBLISH_TIMEOUT_S = 0.5
    broker_at(silent_broker_url)
    started = time.monotonic()

    with django_capture_on_commit_callbacks(execute=True):
        message = do_enqueue_task(TASK, 7)

    assert time.monotonic() - started < 5  # the worker's socket timeout is 5 s
    message.refresh_from_db()
    assert (message.sent, message.attempts) == (None, 1)
    assert "timeout" in message.last_error.lower()


def test_a_result_store_that_is_down_costs_the_publish_nothing(
    db,
    working_broker,
    result_store_at,
    unreachable_broker_url,
    queue_name,
    django_capture_on_commit_callbacks,
):
    result_store_at(unreachable_broker_url)  # Redis on a closed port
    started = time.monotonic()

    with django_capture_on_commit_callbacks(execute=True):
        message = do_enqueue_task(TASK, 7, queue=queue_name)

    # Was ~19 s: the result backend retried subscribing to the result 20 x 1 s.
    assert time.monotonic() - started < 2
    message.refresh_from_db()
    assert (message.attempts, message.last_error) == (1, "")
    assert message.sent is not None
    assert received(queue_name) == [(TASK, [7])]
