from celery import shared_task

from controlplane.fleet.actions import do_record_heartbeat
from gpuagent.protocol import Heartbeat


@shared_task(name="controlplane.fleet.record_heartbeat")
def record_heartbeat(beat: dict) -> str:
    """An agent's heartbeat (gpuagent.worker): who it is, its memory, what it runs.
    A malformed beat is dropped (returns why) rather than retried."""
    try:
        parsed = Heartbeat.model_validate(beat)
    except ValueError as exc:
        return f"invalid heartbeat: {exc}"
    return do_record_heartbeat(parsed).state
