from celery import shared_task

from controlplane.webhooks.actions import attempt_delivery


@shared_task(name="controlplane.webhooks.deliver")
def deliver_webhook(delivery_id: int) -> str:
    """One attempt; a failed one queues the next after its backoff (bounded by
    RELEASEGATE_WEBHOOK_MAX_ATTEMPTS). Returns the delivery's state."""
    state, retry_in = attempt_delivery(delivery_id)
    if retry_in is not None:
        deliver_webhook.apply_async((delivery_id,), countdown=retry_in)
    return state
