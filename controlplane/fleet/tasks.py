from celery import shared_task

from controlplane.releases import pipeline
from gpuagent.protocol import Heartbeat


@shared_task(name="controlplane.fleet.record_heartbeat")
def record_heartbeat(beat: dict) -> str:
    """An agent's heartbeat (gpuagent.worker): who it is, which start of it, its
    memory, what it runs; a restarted agent's jobs are sent again at once. A
    malformed beat is dropped (returns why) rather than retried."""
    try:
        parsed = Heartbeat.model_validate(beat)
    except ValueError as exc:
        return f"invalid heartbeat: {exc}"
    return pipeline.record_heartbeat(parsed).state
