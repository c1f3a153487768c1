from celery import shared_task

from controlplane.audit.actions import chain_pending, do_close_event_windows


@shared_task(name="controlplane.audit.chain_pending")
def chain_pending_events() -> int:
    """Periodic (celery beat): chain audit events whose on-commit chaining was lost.
    Returns how many it chained."""
    return chain_pending()


@shared_task(name="controlplane.audit.close_event_windows")
def close_event_windows() -> int:
    """Periodic (celery beat): record the counts of flood-bounded events (refused
    agent messages) whose window has passed. Returns how many it recorded."""
    return do_close_event_windows()
