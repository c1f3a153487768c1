"""An environment's gate policy."""

from django.db import transaction
from pydantic import ValidationError

from controlplane.accounts.actions import check_actor_in_team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import validation_failed
from controlplane.fleet.models import Environment
from controlplane.releases.gates import GatePolicy
from controlplane.releases.models import EnvironmentGatePolicy


def gate_policy_for(environment: Environment) -> GatePolicy:
    """The environment's gate policy; the default GatePolicy() when none is set."""
    row = EnvironmentGatePolicy.objects.filter(environment=environment).first()
    return row.spec if row is not None else GatePolicy()


def do_set_gate_policy(
    environment: Environment, policy: dict, *, actor: Actor
) -> EnvironmentGatePolicy:
    """Replace the environment's gate policy (admin role; a token needs the admin
    scope). ValidationFailed names the first bad field, e.g. policy.quality.x."""
    check_actor_in_team(actor, environment.team, scope="admin", roles=("admin",))
    try:
        spec = GatePolicy.model_validate(policy)
    except ValidationError as exc:
        raise validation_failed(exc, "policy") from exc
    with transaction.atomic():
        before = gate_policy_for(environment).model_dump(mode="json")
        row, _ = EnvironmentGatePolicy.objects.update_or_create(
            environment=environment, defaults={"policy": spec.model_dump(mode="json")}
        )
        do_record_event(
            actor,
            "environment.gate_policy_set",
            environment,
            before={"policy": before},
            after={"policy": row.policy},
            team=environment.team,
        )
    return row
