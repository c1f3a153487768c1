"""An environment's load-test plan: GET/PUT/PATCH with the cost model's semantics
(controlplane.loadplans.actions)."""

from django.http import HttpRequest
from ninja import Router

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    LoadPlanChangeIn,
    LoadPlanIn,
    LoadPlanOut,
    ObjectId,
)
from controlplane.api.scoping import get_environment, principal_of
from controlplane.fleet.models import Environment
from controlplane.loadplans.actions import (
    do_set_load_plan,
    do_update_load_plan,
    load_plan_of,
)

router = Router(tags=["environments"])


def load_plan_dict(environment: Environment) -> dict:
    plan, is_default = load_plan_of(environment)
    return {
        "environment": environment.name,
        "load_plan": plan.model_dump(mode="json"),
        "is_default": is_default,
    }


@router.get(
    "/environments/{environment_id}/load-plan",
    auth=read_auth(),
    response={200: LoadPlanOut, **READ_ERRORS},
    summary="The environment's load-test plan (the default until one is set)",
)
def get_load_plan(request: HttpRequest, environment_id: ObjectId) -> dict:
    return load_plan_dict(get_environment(principal_of(request), environment_id))


@router.put(
    "/environments/{environment_id}/load-plan",
    auth=token_auth("admin"),
    response={200: LoadPlanOut, **WRITE_ERRORS},
    summary="Replace the environment's load-test plan (admin role)",
    description="The body is the whole plan: `workloads` and `budget_s` are "
    "required, any other key left out takes its default; unknown keys are "
    "refused. Audited (`environment.load_plan_set`). The next load test of a "
    "release for this environment runs it, and its report carries it.",
)
def put_load_plan(
    request: HttpRequest, environment_id: ObjectId, payload: LoadPlanIn
) -> dict:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    do_set_load_plan(
        environment, payload.model_dump(mode="json"), actor=principal.token, prefix=""
    )
    return load_plan_dict(environment)


@router.patch(
    "/environments/{environment_id}/load-plan",
    auth=token_auth("admin"),
    response={200: LoadPlanOut, **WRITE_ERRORS},
    summary="Change keys of the environment's load-test plan (admin role)",
    description="Only the keys the body names change (of the default plan when "
    "none is set); an object merges key by key, a list or a value replaces, "
    "null clears an optional key. Audited.",
)
def patch_load_plan(
    request: HttpRequest, environment_id: ObjectId, payload: LoadPlanChangeIn
) -> dict:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    do_update_load_plan(
        environment,
        payload.model_dump(mode="json", exclude_unset=True),
        actor=principal.token,
        prefix="",
    )
    return load_plan_dict(environment)
