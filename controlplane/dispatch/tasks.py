from celery import shared_task

from controlplane.dispatch.actions import publish_pending


@shared_task(name="controlplane.dispatch.relay_outbox")
def relay_outbox() -> int:
    """Periodic (celery beat): publish what a commit could not (broker down then).
    Returns how many messages went out."""
    return publish_pending()
