from django.http import HttpRequest
from ninja import Router

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    ObjectId,
    ServingBackendChangeIn,
    ServingBackendIn,
    ServingBackendOut,
    ServingPresetsOut,
)
from controlplane.api.scoping import get_environment, principal_of
from controlplane.fleet.actions import (
    do_set_serving_backend,
    do_update_serving_backend,
)
from controlplane.fleet.backend import AGENT_PRESETS, backend_spec
from controlplane.fleet.models import Environment, ServingPreset

router = Router(tags=["environments"])


def backend_dict(environment: Environment) -> dict:
    spec = backend_spec(environment.serving_backend)
    return {
        "environment": environment.name,
        "backend": spec.model_dump(include=set(ServingBackendIn.model_fields)),
    }


@router.get(
    "/environments/{environment_id}/serving-backend",
    auth=read_auth(),
    response={200: ServingBackendOut, **READ_ERRORS},
    summary="How the environment's deploy jobs serve a release",
)
def get_serving_backend(request: HttpRequest, environment_id: ObjectId) -> dict:
    return backend_dict(get_environment(principal_of(request), environment_id))


@router.put(
    "/environments/{environment_id}/serving-backend",
    auth=token_auth("admin"),
    response={200: ServingBackendOut, **WRITE_ERRORS},
    summary="Set the environment's serving backend (admin role)",
    description="`kind` engine (the project's engine; no preset or template, one "
    "device) or external (a `preset` by name: the agent's vllm or one a platform "
    "operator named). `command_template` is for platform operators only: a team "
    "admin setting one gets 403. Sent with every later deploy job of the "
    "environment.",
)
def put_serving_backend(
    request: HttpRequest, environment_id: ObjectId, payload: ServingBackendIn
) -> dict:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    environment = do_set_serving_backend(
        environment, payload.model_dump(), actor=principal.token
    )
    return backend_dict(environment)


@router.patch(
    "/environments/{environment_id}/serving-backend",
    auth=token_auth("admin"),
    response={200: ServingBackendOut, **WRITE_ERRORS},
    summary="Change keys of the environment's serving backend (admin role)",
    description="Only the keys the body names change; every other keeps its "
    'current value: `{"gate_evidence": "serving_backend"}` makes the gate\'s '
    "quality and load tests run on this backend over HTTP and leaves the engine, "
    "preset and limits as they are. The result is checked whole, as a PUT's "
    "body; answers the setting now in force.",
)
def patch_serving_backend(
    request: HttpRequest, environment_id: ObjectId, payload: ServingBackendChangeIn
) -> dict:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    environment = do_update_serving_backend(
        environment, payload.model_dump(exclude_unset=True), actor=principal.token
    )
    return backend_dict(environment)


@router.get(
    "/serving-presets",
    auth=read_auth(),
    response={200: ServingPresetsOut, **READ_ERRORS},
    summary="The serving presets an environment's backend may choose by name",
    description="The agent's own (vllm) and those platform operators named in the "
    "admin; only operators write command templates.",
)
def list_serving_presets(request: HttpRequest) -> dict:
    own = [
        {"name": name, "command_template": "", "description": "the agent's own preset"}
        for name in AGENT_PRESETS
    ]
    named = [p.to_dict() for p in ServingPreset.objects.order_by("name")]
    return {"presets": own + named}
