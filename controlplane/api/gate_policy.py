from django.http import HttpRequest
from ninja import Router

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    GatePolicyChangeIn,
    GatePolicyIn,
    GatePolicyOut,
    ObjectId,
)
from controlplane.api.scoping import get_environment, principal_of
from controlplane.fleet.models import Environment
from controlplane.releases.actions.gate_policies import (
    do_set_gate_policy,
    do_update_gate_policy,
    gate_policy_in_force,
)
from controlplane.releases.models import EnvironmentGatePolicy

router = Router(tags=["environments"])


def gate_policy_dict(environment: Environment) -> dict:
    policy, version = gate_policy_in_force(environment)
    return {
        "environment": environment.name,
        "policy": policy.model_dump(mode="json"),
        "version": version,
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
    "gating on it), inside which a key left out takes its default and null turns "
    "that check off. Answers the policy now in force. Integrity is always gated. "
    "Defaults and meanings: README, Gate policy.",
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


@router.patch(
    "/environments/{environment_id}/gate-policy",
    auth=token_auth("admin"),
    response={200: GatePolicyOut, **WRITE_ERRORS},
    summary="Change keys of the environment's gate policy (admin role)",
    description="Only the keys the body names change; every other keeps its "
    "current value (the default's, when no policy is set). An object merges key by "
    'key, anything else replaces: `{"quality": {"thresholds": '
    '{"max_mean_kld": 0.01}}}` changes one threshold, null turns it off. '
    "Answers the policy now in force. README, Gate policy.",
)
def patch_gate_policy(
    request: HttpRequest, environment_id: ObjectId, payload: GatePolicyChangeIn
) -> dict:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    do_update_gate_policy(
        environment,
        payload.model_dump(mode="json", exclude_unset=True),
        actor=principal.token,
        prefix="",
    )
    return gate_policy_dict(environment)
