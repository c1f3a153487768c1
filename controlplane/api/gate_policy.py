from django.http import HttpRequest
from ninja import Router

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    GatePolicyIn,
    GatePolicyOut,
    ObjectId,
)
from controlplane.api.scoping import get_environment, principal_of
from controlplane.fleet.models import Environment
from controlplane.releases.actions.gate_policies import (
    do_set_gate_policy,
    gate_policy_for,
)
from controlplane.releases.models import EnvironmentGatePolicy

router = Router(tags=["environments"])


def gate_policy_dict(environment: Environment) -> dict:
    return {
        "environment": environment.name,
        "policy": gate_policy_for(environment).model_dump(mode="json"),
        "is_default": not EnvironmentGatePolicy.objects.filter(
            environment=environment
        ).exists(),
    }


@router.get(
    "/environments/{environment_id}/gate-policy",
    auth=read_auth(),
    response={200: GatePolicyOut, **READ_ERRORS},
    summary="The environment's gate policy (the default until one is set)",
)
def get_gate_policy(request: HttpRequest, environment_id: ObjectId) -> dict:
    environment = get_environment(principal_of(request), environment_id)
    return gate_policy_dict(environment)


@router.put(
    "/environments/{environment_id}/gate-policy",
    auth=token_auth("admin"),
    response={200: GatePolicyOut, **WRITE_ERRORS},
    summary="Replace the environment's gate policy (admin role)",
    description="The body is the whole policy: `quality` and `load` (null stops "
    "gating on it), inside which a key left out takes its default. Integrity is "
    "always gated. Defaults and meanings: README, Gate policy.",
)
def put_gate_policy(
    request: HttpRequest, environment_id: ObjectId, payload: GatePolicyIn
) -> dict:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    do_set_gate_policy(
        environment, payload.model_dump(mode="json"), actor=principal.token
    )
    return gate_policy_dict(environment)
