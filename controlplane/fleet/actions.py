from django.db import transaction
from django.utils import timezone

from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import ValidationFailed
from controlplane.fleet.models import AGENT_STATES, Agent


def do_register_agent(
    name: str,
    *,
    queue: str,
    gpu_model: str = "",
    gpu_memory_bytes: int = 0,
    capabilities: dict | None = None,
    actor: Actor = "system:agent",
) -> Agent:
    """Create or update an agent by name (agents re-register on every start)."""
    if not name or not queue:
        raise ValidationFailed("agents need a name and a queue", field="name")
    if gpu_memory_bytes < 0:
        raise ValidationFailed(
            "gpu_memory_bytes must be >= 0", field="gpu_memory_bytes"
        )
    with transaction.atomic():
        agent, created = Agent.objects.select_for_update().get_or_create(
            name=name, defaults={"queue": queue}
        )
        before = {} if created else agent.to_dict()
        agent.queue = queue
        agent.gpu_model = gpu_model
        agent.gpu_memory_bytes = gpu_memory_bytes
        agent.capabilities = capabilities or {}
        agent.state = "online"
        agent.last_heartbeat = timezone.now()
        agent.save()
        do_record_event(
            actor, "agent.registered", agent, before=before, after=agent.to_dict()
        )
    return agent


def do_record_agent_heartbeat(agent: Agent) -> Agent:
    # Not audited: heartbeats are frequent bookkeeping, not decisions.
    now = timezone.now()
    Agent.objects.filter(pk=agent.pk).update(last_heartbeat=now, state="online")
    agent.last_heartbeat, agent.state = now, "online"
    return agent


def do_set_agent_state(agent: Agent, state: str, *, actor: Actor) -> Agent:
    if state not in AGENT_STATES:
        raise ValidationFailed(
            f"state must be one of {', '.join(AGENT_STATES)}", field="state"
        )
    with transaction.atomic():
        before = {"state": agent.state}
        Agent.objects.filter(pk=agent.pk).update(state=state)
        agent.state = state
        do_record_event(
            actor, "agent.state_set", agent, before=before, after={"state": state}
        )
    return agent
