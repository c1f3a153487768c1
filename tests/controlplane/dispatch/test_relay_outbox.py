from datetime import timedelta

from django.utils import timezone

from controlplane.dispatch.actions import do_enqueue_task, retry_delay_s
from controlplane.dispatch.models import OutboxMessage
from controlplane.dispatch.tasks import relay_outbox
from tests.controlplane.dispatch.conftest import received

TASK = "controlplane.releases.run_deployment"


def make_due(*messages) -> None:
    OutboxMessage.objects.filter(pk__in=[m.pk for m in messages]).update(
        next_attempt=timezone.now() - timedelta(seconds=1)
    )


def test_it_sends_what_the_commit_could_not_once_the_broker_is_back(
    db, broker_at, unreachable_broker_url, working_broker, queue_name, settings
):
    settings.RELEASEGATE_OUTBOX_PUBLISH_ON_COMMIT = False
    first = do_enqueue_task(TASK, 1, queue=queue_name)
    second = do_enqueue_task(TASK, 2, queue=queue_name)
    broker_at(unreachable_broker_url)

    assert relay_outbox() == 0  # stops at the first refusal

    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.attempts, first.sent, second.attempts) == (1, None, 0)
    assert relay_outbox() == 0  # the first backs off; the second is tried
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.attempts, second.attempts) == (1, 1)
    broker_at(working_broker)
    make_due(first, second)

    assert relay_outbox() == 2

    assert received(queue_name) == [(TASK, [1]), (TASK, [2])]
    assert OutboxMessage.objects.filter(sent__isnull=True).count() == 0
    assert relay_outbox() == 0  # nothing is sent twice


def test_it_backs_off_doubling_up_to_a_cap(settings):
    settings.RELEASEGATE_OUTBOX_MAX_DELAY_S = 60

    assert [retry_delay_s(n) for n in (1, 2, 3, 4, 7, 20)] == [1, 2, 4, 8, 60, 60]
