from celery import shared_task

from controlplane.releases import intake


@shared_task(name="controlplane.fleet.record_heartbeat")
def record_heartbeat(beat: dict, seal: dict | None = None) -> str:
    """An agent's sealed heartbeat (gpuagent.worker): who it is comes from its
    enrollment; which start of it, its memory, what it runs from the beat; a
    restarted agent's jobs are sent again at once. An unsigned, forged, replayed
    or stale beat is refused (audited); one of a key no agent is enrolled with
    files a pending enrollment. Returns the agent's state, "pending" or
    "refused"."""
    return intake.accept_heartbeat(beat, seal)
