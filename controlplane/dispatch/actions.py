"""The one writer of OutboxMessage rows. Every write that wants a Celery task run
calls `do_enqueue_task` inside its transaction, instead of `.delay()`:

    with transaction.atomic():
        ...  # the state change
        do_enqueue_task("controlplane.releases.run_promotion", release.pk)

The row commits or rolls back with the change. Once the outermost transaction has
committed, the message is published at once (broker timeouts are short, see
settings); if the broker can't take it, it stays pending and `relay_outbox` (beat,
every RELEASEGATE_OUTBOX_RELAY_S) sends it later, with backoff. A request therefore
never waits on, or fails with, the broker."""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.dispatch.models import OutboxMessage
from controlplane.settings import broker_transport_options

log = logging.getLogger(__name__)


def do_enqueue_task(task: str, *args, queue: str = "") -> OutboxMessage:
    """Queue the Celery task named `task` with JSON-serialisable `args` (ids, never
    model objects) to `queue` (the app's default when empty), as part of the
    caller's transaction. Never raises for a broker problem."""
    message = OutboxMessage.objects.create(task=task, args=list(args), queue=queue)
    if settings.RELEASEGATE_OUTBOX_PUBLISH_ON_COMMIT:
        # robust: a failure here is logged, never raised into the committed request.
        transaction.on_commit(lambda: publish_pending(ids=[message.pk]), robust=True)
    return message


def retry_delay_s(attempts: int) -> float:
    """Wait after the `attempts`-th failed send: doubling from 1 s, capped."""
    return float(
        min(2 ** max(attempts - 1, 0), settings.RELEASEGATE_OUTBOX_MAX_DELAY_S)
    )


def publish_pending(*, ids: list[int] | None = None, limit: int = 200) -> int:
    """Send unsent messages that are due (only `ids`, when given), oldest first, on
    one broker connection; returns how many the broker took. At the first broker
    error the message that failed is pushed back by `retry_delay_s` and the rest are
    left for the relay. Rows another relay holds are skipped (PostgreSQL)."""
    from controlplane.celery import app

    sent = 0
    with transaction.atomic():
        due = OutboxMessage.objects.select_for_update(skip_locked=True).filter(
            sent__isnull=True, next_attempt__lte=timezone.now()
        )
        if ids is not None:
            due = due.filter(pk__in=ids)
        batch = list(due.order_by("created", "id")[:limit])
        if not batch:
            return 0
        # A broker that takes the connection and then says nothing costs a
        # publish RELEASEGATE_OUTBOX_PUBLISH_TIMEOUT_S, not the worker's timeout.
        options = broker_transport_options(
            app.conf.broker_write_url,
            connect_timeout_s=settings.BROKER_CONNECT_TIMEOUT_S,
            socket_timeout_s=settings.RELEASEGATE_OUTBOX_PUBLISH_TIMEOUT_S,
        )
        try:
            with app.connection_for_write(transport_options=options) as connection:
                for message in batch:
                    app.send_task(
                        message.task,
                        args=message.args,
                        queue=message.queue or None,
                        connection=connection,
                        retry=False,  # this table is the retry
                        # no result store to wait on: nothing reads results
                        ignore_result=True,
                    )
                    message.sent = timezone.now()
                    message.attempts += 1
                    message.save(update_fields=["sent", "attempts"])
                    sent += 1
        except Exception as exc:  # unreachable, refused, timed out: try again later
            failed = batch[sent]
            failed.attempts += 1
            failed.last_error = f"{type(exc).__name__}: {exc}"[:2000]
            failed.next_attempt = timezone.now() + timedelta(
                seconds=retry_delay_s(failed.attempts)
            )
            failed.save(update_fields=["attempts", "last_error", "next_attempt"])
            log.warning(
                "broker refused %s (attempt %d); %d message(s) left pending: %s",
                failed,
                failed.attempts,
                len(batch) - sent,
                failed.last_error,
            )
    return sent
