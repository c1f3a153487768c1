from celery import shared_task

from controlplane.audit.actions import chain_pending


@shared_task(name="controlplane.audit.chain_pending")
def chain_pending_events() -> int:
    """Periodic (celery beat): chain audit events whose on-commit chaining was lost.
    Returns how many it chained."""
    return chain_pending()
