"""Which enrolled agents may start an environment's external serving backend.

An external backend starts a program from a command template on the agent, as the
agent's user. Each agent checks a template against its own list before it starts
anything (gpuagent.serving.templates.check_allowed_shape); the control plane checks
the list an operator enrolled the agent with (`Agent.allowed_programs`) with the
same rule (gpuagent.protocol.allowed_shape_problem): a deploy for an external
backend goes only to an agent whose record allows the template's whole argument
shape, and a deploy result from one whose record does not is refused.

An entry of the record is the name of a preset (the agent's own, e.g. `vllm`, or an
operator's ServingPreset: its template of now) or a command template of its own.
A record of None leaves the choice to the agent's own list, as the enrollment API
documents ("null: its own list"): such an agent is eligible, and it refuses a
template its own list does not allow (the deploy fails with that reason). An
operator who wants the control plane to decide enrolls the agent with a list
(`[]`: no external backend at all)."""

from controlplane.errors import ValidationFailed
from controlplane.fleet.models import Agent, ServingPreset
from gpuagent.protocol import (
    AGENT_PRESET_TEMPLATES,
    BackendSpec,
    allowed_shape_problem,
    command_template_words,
)


def external_template(spec: BackendSpec) -> str:
    """The command template a deploy with `spec` starts ("" for the project's
    engine; an unknown preset's name as it is: nothing allows it)."""
    if spec.kind != "external":
        return ""
    if spec.command_template:
        return spec.command_template
    return AGENT_PRESET_TEMPLATES.get(spec.preset, spec.preset)


def preset_templates() -> dict[str, str]:
    """Every preset name an agent record may allow, with its template of now."""
    presets = dict(ServingPreset.objects.values_list("name", "command_template"))
    return {**presets, **AGENT_PRESET_TEMPLATES}


def record_problem(agent: Agent, template: str) -> str:
    """Why `agent`'s enrollment does not allow starting `template` ("" when it
    does, or when the record leaves it to the agent's own list: None)."""
    if not template or agent.allowed_programs is None:
        return ""
    try:
        return allowed_shape_problem(
            template,
            agent.allowed_programs,
            preset_templates(),
            holder=f"agent {agent.name} is enrolled to start",
        )
    except ValueError as exc:
        return f"the command template cannot be run: {exc}"


def eligible_agents(agents, template: str) -> list[Agent]:
    """Those of `agents` whose record allows `template`: the ones whose record
    names it first (the control plane checked them), then the ones that leave it
    to their own list; by name within each."""
    allowed = [a for a in agents if not record_problem(a, template)]
    return sorted(allowed, key=lambda a: (a.allowed_programs is None, a.name))


def clean_allowed_programs(value: object) -> list[str] | None:
    """An enrollment's allowed programs as stored: None, or a list of preset
    names and command templates the agent could run. ValidationFailed names the
    first bad entry."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ValidationFailed(
            "allowed_programs must be a list of preset names or command "
            "templates, or null (the agent's own list)",
            field="allowed_programs",
        )
    for entry in value:
        try:
            command_template_words(entry)
        except ValueError as exc:
            raise ValidationFailed(
                f"allowed_programs: {entry!r}: {exc}", field="allowed_programs"
            ) from exc
    return list(dict.fromkeys(value))
