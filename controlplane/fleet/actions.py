import re
from datetime import datetime, timedelta

from django.contrib.auth.base_user import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.accounts.actions import check_actor_in_team
from controlplane.accounts.models import Team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import Conflict, Forbidden, ValidationFailed
from controlplane.fleet.backend import (
    AGENT_PRESETS,
    check_command_template,
    clean_backend,
)
from controlplane.fleet.models import AGENT_STATES, Agent, Environment, ServingPreset
from gpuagent.protocol import Heartbeat


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


def do_record_agent_heartbeat(agent: Agent, beat: Heartbeat | None = None) -> Agent:
    """The agent is alive now; with `beat`, also what it reports about itself."""
    # Not audited: heartbeats are frequent bookkeeping, not decisions.
    now = timezone.now()
    fields = {"last_heartbeat": now}
    # A draining agent stays draining; an offline one is back.
    Agent.objects.filter(pk=agent.pk, state="offline").update(state="online")
    if beat is not None:
        fields.update(
            queue=beat.queue,
            device=beat.device,
            gpu_model=beat.gpu_model[:100],
            gpu_memory_bytes=beat.memory_total_bytes,
            gpu_memory_free_bytes=beat.memory_free_bytes,
            running_jobs=beat.running_jobs,
            loaded_deployments=[d.model_dump(mode="json") for d in beat.deployments],
            capabilities={"can_sign": beat.can_sign, "pool_queue": beat.pool_queue},
        )
        fields["devices"] = [d.model_dump() for d in beat.devices]
        if agent.enrollment:  # who it is comes from its enrollment, never a beat
            fields.update(queue=agent.queue, capabilities=agent.enrolled_capabilities())
            fields["devices"], outside = enrolled_device_state(agent, beat)
            if outside != agent.devices_outside_enrollment:
                fields["devices_outside_enrollment"] = outside
                do_record_event(
                    f"agent:{agent.name}",
                    "agent.devices_outside_enrollment",
                    agent,
                    before={"devices": agent.devices_outside_enrollment},
                    after={"devices": outside},
                )
    Agent.objects.filter(pk=agent.pk).update(**fields)
    for name, value in fields.items():
        setattr(agent, name, value)
    agent.state = Agent.objects.values_list("state", flat=True).get(pk=agent.pk)
    return agent


def enrolled_device_state(agent: Agent, beat: Heartbeat) -> tuple[list, list]:
    """(the enrolled devices with the free memory `beat` reports of each, the
    indices it names outside the enrollment). Model and total memory stay the
    enrollment's; a free figure above the enrolled total is cut to it; an
    enrolled device the beat leaves out has None (not reported)."""
    reported = {d.index: d for d in beat.devices}
    state = []
    for device in agent.enrolled_devices:
        seen = reported.get(device["index"])
        total = device["memory_total_bytes"]
        free = min(seen.memory_free_bytes, total) if seen else None
        state.append({**device, "memory_free_bytes": free})
    enrolled = set(agent.device_indices)
    return state, sorted(i for i in reported if i not in enrolled)


def do_record_heartbeat(beat: Heartbeat) -> Agent:
    """A heartbeat from the agent named in it: registered on its first beat (and
    after being marked offline it is online again). Agents' own beats come here
    only through the intake (controlplane.releases.intake): sealed by an enrolled
    agent, under its enrolled name, queue and capabilities. A beat from another
    incarnation than the recorded one (the agent restarted under its name) records
    the new incarnation and its start, audited `agent.restarted`; a late beat of an
    incarnation that started before the recorded one (a dead process's, delivered
    after its successor's) changes nothing."""
    with transaction.atomic():
        agent = Agent.objects.select_for_update().filter(name=beat.agent).first()
        if agent is None:
            agent = do_register_agent(
                beat.agent,
                queue=beat.queue,
                gpu_model=beat.gpu_model[:100],
                gpu_memory_bytes=beat.memory_total_bytes,
            )
        if beat.incarnation and beat.incarnation != agent.incarnation:
            if _started_before(beat.started, agent.started):
                return agent
            do_record_agent_incarnation(agent, beat.incarnation, started=beat.started)
        return do_record_agent_heartbeat(agent, beat)


def _started_before(started, other) -> bool:
    return started is not None and other is not None and started < other


def do_record_agent_incarnation(
    agent: Agent, incarnation: str, *, started: datetime | None
) -> Agent:
    """Record which start of the agent's process beats now. Audited
    `agent.restarted` when it replaces another incarnation (not on the first one
    an agent reports)."""
    with transaction.atomic():
        before = _incarnation_of(agent)
        Agent.objects.filter(pk=agent.pk).update(
            incarnation=incarnation, started=started
        )
        agent.incarnation, agent.started = incarnation, started
        if before["incarnation"]:
            do_record_event(
                "system:fleet",
                "agent.restarted",
                agent,
                before=before,
                after=_incarnation_of(agent),
            )
    return agent


def _incarnation_of(agent: Agent) -> dict:
    data = agent.to_dict()
    return {"incarnation": data["incarnation"], "started": data["started"]}


def silent_agents(timeout_s: float):
    """Online or draining agents whose last heartbeat is older than `timeout_s`."""
    cutoff = timezone.now() - timedelta(seconds=timeout_s)
    return Agent.objects.filter(
        state__in=("online", "draining"), last_heartbeat__lt=cutoff
    )


def do_set_agent_state(agent: Agent, state: str, *, actor: Actor) -> Agent:
    if state not in AGENT_STATES:
        raise ValidationFailed(
            f"state must be one of {', '.join(AGENT_STATES)}", field="state"
        )
    if agent.enrollment == "revoked" and state != "offline":
        raise Conflict(f"agent {agent.name} is revoked", field="state")
    with transaction.atomic():
        before = {"state": agent.state}
        Agent.objects.filter(pk=agent.pk).update(state=state)
        agent.state = state
        do_record_event(
            actor, "agent.state_set", agent, before=before, after={"state": state}
        )
    return agent


def do_set_serving_backend(
    environment: Environment, backend: dict, *, actor: Actor
) -> Environment:
    """Set how the environment's deploy jobs serve (admin role; a token needs the
    admin scope). ValidationFailed names the bad or unknown key; a command
    template is Forbidden but to a platform operator (teams choose presets)."""
    check_actor_in_team(actor, environment.team, scope="admin", roles=("admin",))
    cleaned = clean_backend(backend, operator=is_platform_operator(actor))
    with transaction.atomic():
        environment = Environment.objects.select_for_update().get(pk=environment.pk)
        _write_serving_backend(environment, cleaned, actor)
    return environment


def do_update_serving_backend(
    environment: Environment, changes: dict, *, actor: Actor
) -> Environment:
    """Change the keys of the environment's serving backend that `changes` names
    (admin role); the others keep their stored values, and the result is checked
    whole (ValidationFailed naming the key). A command template the change leaves
    as it is may stay under a team admin's change of another key: only writing
    one is an operator's."""
    check_actor_in_team(actor, environment.team, scope="admin", roles=("admin",))
    with transaction.atomic():
        environment = Environment.objects.select_for_update().get(pk=environment.pk)
        stored = environment.serving_backend or {}
        merged = {**stored, **changes}
        same_template = merged.get("command_template", "") == stored.get(
            "command_template", ""
        )
        cleaned = clean_backend(
            merged, operator=is_platform_operator(actor) or same_template
        )
        _write_serving_backend(environment, cleaned, actor)
    return environment


def _write_serving_backend(
    environment: Environment, cleaned: dict, actor: Actor
) -> None:
    """Store a cleaned setting on a locked environment, with its audit event."""
    before = environment.serving_backend
    environment.serving_backend = cleaned
    environment.save(update_fields=["serving_backend"])
    do_record_event(
        actor,
        "environment.serving_backend_set",
        environment,
        before={"serving_backend": before},
        after={"serving_backend": cleaned},
        team=environment.team,
    )


def do_create_environment(team: Team, name: str, *, actor: Actor) -> Environment:
    check_actor_in_team(actor, team, roles=("admin",))
    try:
        with transaction.atomic():
            environment = Environment.objects.create(team=team, name=name)
            do_record_event(
                actor,
                "environment.created",
                environment,
                after=environment.to_dict(),
                team=team,
            )
    except IntegrityError as exc:
        raise Conflict(
            f"environment {name!r} already exists in team {team.slug}", field="name"
        ) from exc
    return environment


def is_platform_operator(actor: Actor) -> bool:
    """A person acting in their own name as Django staff (or superuser). A token
    is bound to one team and never counts, whoever holds it."""
    return (
        isinstance(actor, AbstractBaseUser)
        and actor.is_active
        and (actor.is_staff or actor.is_superuser)
    )


def do_set_serving_preset(
    name: str, command_template: str, *, actor: Actor, description: str = ""
) -> ServingPreset:
    """Create or change the named preset (platform operators only: Forbidden
    otherwise). ValidationFailed for a name that is not a slug or is one of the
    agent's own presets, or a template the agent could not run. Environments that
    chose it deploy with the new template from their next deploy job."""
    if not is_platform_operator(actor):
        raise Forbidden(
            "serving presets are set only by platform operators (staff)",
            field="command_template",
        )
    if not re.fullmatch(r"[-a-zA-Z0-9_]{1,50}", name or ""):
        raise ValidationFailed(
            "name: a preset's name is a slug of 1 to 50 letters, digits, - or _",
            field="name",
        )
    if name in AGENT_PRESETS:
        raise ValidationFailed(
            f"name: {name!r} is one of the agent's own presets", field="name"
        )
    check_command_template(command_template, "command_template")
    with transaction.atomic():
        preset = ServingPreset.objects.select_for_update().filter(name=name).first()
        before = preset.to_dict() if preset else {}
        preset = preset or ServingPreset(name=name)
        preset.command_template = command_template
        preset.description = description
        preset.save()
        do_record_event(
            actor, "serving_preset.set", preset, before=before, after=preset.to_dict()
        )
    return preset
