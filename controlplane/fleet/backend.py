"""An environment's serving backend: which engine its deploy jobs start.

The setting is the part of `gpuagent.protocol.BackendSpec` an operator chooses per
environment: `kind` (engine | external), `preset` (e.g. "vllm") or
`command_template`, `tensor_parallel_size`, an external engine's `max_model_len`
and `gpu_memory_utilization` (null: the agent's defaults), `health_timeout_s` (null:
120 s for the engine, 1800 s for an external engine), `kv_scale_strategy` (the
fp8 KV-scale layout releases for this environment are compressed with: tensor, or
attn_head where the engine reads per-head scales) and `gate_evidence` (where the
evaluate and load_test jobs measure: in_process, the default, for small models, or
serving_backend: the candidate and its parent started on this backend and measured
over HTTP, the engine that will serve). Everything else of a BackendSpec
(host, the engine's thread and memory knobs) is the agent's. Validated here, where
it is set (admin and API), so a deploy never starts with a setting the backend
would not read; unknown keys are refused by name. Stored in the environment's JSON
field: older settings without the newer keys read as their defaults.

A command template runs as the agent's user on agents shared by teams, so only a
platform operator (Django staff) writes one: as a named ServingPreset that team
admins choose by name, or (operators only) straight into an environment. A preset
is one of the agent's own (AGENT_PRESETS) or a ServingPreset row, whose template
deploy jobs carry (`job_backend`)."""

from pydantic import ValidationError

from controlplane.errors import Forbidden, ValidationFailed, validation_failed
from controlplane.fleet.models import ServingPreset
from gpuagent.protocol import BackendSpec, command_template_words

BACKEND_KEYS = (
    "kind",
    "preset",
    "command_template",
    "tensor_parallel_size",
    "max_model_len",
    "gpu_memory_utilization",
    "health_timeout_s",
    "kv_scale_strategy",
    "gate_evidence",
)
# Settings only an external engine reads (passed as its flags).
EXTERNAL_KEYS = ("max_model_len", "gpu_memory_utilization")
# The agent's own named presets (gpuagent.serving.templates.PRESETS; a test keeps
# the two the same): sent by name, the agent holds their templates.
AGENT_PRESETS = ("vllm",)


def known_presets() -> list[str]:
    """Every preset name an environment may choose, sorted."""
    names = ServingPreset.objects.values_list("name", flat=True)
    return sorted({*AGENT_PRESETS, *names})


def clean_backend(data: object, *, operator: bool = False) -> dict:
    """The stored form of a backend setting ({} is the project's engine);
    ValidationFailed naming the first problem (`backend.<key>`). A command
    template is refused (Forbidden) unless `operator` (a platform operator sets
    it); a preset must be a known one."""
    if not isinstance(data, dict):
        raise ValidationFailed("backend: expected an object", field="backend")
    unknown = sorted(set(data) - set(BACKEND_KEYS))
    if unknown:
        raise ValidationFailed(
            f"backend: unknown setting(s) {', '.join(unknown)}; an environment's "
            f"backend takes {', '.join(BACKEND_KEYS)}",
            field=f"backend.{unknown[0]}",
        )
    try:
        spec = BackendSpec.model_validate(data)
    except ValidationError as exc:
        raise validation_failed(exc, "backend") from exc
    if spec.command_template and not operator:
        raise Forbidden(
            "backend.command_template: command templates are set only by platform "
            "operators (staff); choose a preset by name instead (known: "
            f"{', '.join(known_presets())})",
            field="backend.command_template",
        )
    if spec.command_template:
        check_command_template(spec.command_template, "backend.command_template")
    if spec.preset and spec.preset not in known_presets():
        raise ValidationFailed(
            f"backend.preset: unknown serving preset {spec.preset!r}; known: "
            f"{', '.join(known_presets())}",
            field="backend.preset",
        )
    if spec.kind == "engine":
        for key in ("preset", "command_template"):
            if getattr(spec, key):
                raise ValidationFailed(
                    f"backend.{key}: the engine backend takes no {key}; set kind "
                    "external to start another engine",
                    field=f"backend.{key}",
                )
        if spec.tensor_parallel_size != 1:
            raise ValidationFailed(
                "backend.tensor_parallel_size: the engine backend serves on one "
                "device; use kind external (e.g. the vllm preset)",
                field="backend.tensor_parallel_size",
            )
        for key in EXTERNAL_KEYS:
            if getattr(spec, key) is not None:
                raise ValidationFailed(
                    f"backend.{key}: a setting of an external engine; the engine "
                    "backend does not read it",
                    field=f"backend.{key}",
                )
    elif bool(spec.preset) == bool(spec.command_template):
        raise ValidationFailed(
            "backend: an external backend needs exactly one of preset or "
            "command_template",
            field="backend.command_template" if spec.preset else "backend.preset",
        )
    elif spec.command_template:
        for key in EXTERNAL_KEYS:
            if getattr(spec, key) is not None and f"{{{key}}}" not in (
                spec.command_template
            ):
                raise ValidationFailed(
                    f"backend.{key}: set, but the command template has no "
                    f"{{{key}}} to pass it on",
                    field=f"backend.{key}",
                )
    return spec.model_dump(include=set(BACKEND_KEYS))


def check_command_template(template: str, field: str) -> None:
    """ValidationFailed (naming `field`) for a template the agent could not run."""
    try:
        command_template_words(template)
    except ValueError as exc:
        raise ValidationFailed(f"{field}: {exc}", field=field) from exc


def backend_spec(stored: dict) -> BackendSpec:
    """A stored setting as a BackendSpec, as it was set (a preset by its name)."""
    return BackendSpec.model_validate(stored or {})


def job_backend(stored: dict) -> BackendSpec:
    """The BackendSpec a deploy job carries for a stored setting: a ServingPreset
    sent as its template of now (the agent knows only its own presets' names); an
    agent preset, or a name no longer known (the agent refuses it by name), as
    it is."""
    spec = backend_spec(stored)
    if not spec.preset or spec.preset in AGENT_PRESETS:
        return spec
    preset = ServingPreset.objects.filter(name=spec.preset).first()
    if preset is None:
        return spec
    return spec.model_copy(
        update={"preset": "", "command_template": preset.command_template}
    )
