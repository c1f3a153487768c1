"""An environment's cost model: replaced whole (PUT) or changed key by key (PATCH),
with the gate policy's semantics (releases.actions.gate_policies): a key left out
of a replacement takes its default, one left out of a change keeps its value, only
an explicit null clears an optional one. Every write is one audited event with both
whole models and the dotted keys that changed."""

from typing import Any

from django.db import transaction
from pydantic import ValidationError

from controlplane.accounts.actions import check_manage_team
from controlplane.audit.actions import Actor
from controlplane.costs.models import EnvironmentCostModel
from controlplane.costs.spec import CostModel
from controlplane.errors import ValidationFailed, validation_failed
from controlplane.fleet.models import Environment
from controlplane.releases.actions.gate_policies import (
    do_bump_gate_policy_version,
    gate_policy_for,
    merged,
    save_environment_spec,
)
from controlplane.releases.gates import prices_with_cost_model


def cost_model_of(environment: Environment) -> tuple[CostModel, bool]:
    """(the environment's cost model, True when none is set and it is the default
    CostModel(), which prices nothing)."""
    row = EnvironmentCostModel.objects.filter(environment=environment).first()
    return (row.spec, False) if row is not None else (CostModel(), True)


def cost_model_for(environment: Environment) -> CostModel:
    """The environment's cost model; the default CostModel() when none is set."""
    return cost_model_of(environment)[0]


def check_cost_model(spec: Any, *, prefix: str = "cost_model") -> CostModel:
    """`spec` (CostModel's JSON) validated; ValidationFailed names the first bad
    field under `prefix`, e.g. cost_model.device_hourly_price."""
    if not isinstance(spec, dict):
        raise ValidationFailed(f"{prefix}: must be a JSON object", field=prefix)
    try:
        return CostModel.model_validate(spec)
    except ValidationError as exc:
        raise validation_failed(exc, prefix) from exc


def do_set_cost_model(
    environment: Environment, spec: dict, *, actor: Actor, prefix: str = "cost_model"
) -> EnvironmentCostModel:
    """Replace the environment's cost model (the team's admin; a token needs the
    admin scope; a superuser signed in to the admin site may too)."""
    check_manage_team(actor, environment.team)
    model = check_cost_model(spec, prefix=prefix)
    return _save(environment, lambda _: model, actor=actor)


def do_update_cost_model(
    environment: Environment, change: dict, *, actor: Actor, prefix: str = "cost_model"
) -> EnvironmentCostModel:
    """Change the named keys of the environment's cost model (see
    gate_policies.merged); read and written under the environment's row lock."""
    check_manage_team(actor, environment.team)
    if not isinstance(change, dict):
        raise ValidationFailed(f"{prefix}: must be a JSON object", field=prefix)
    return _save(
        environment,
        lambda current: check_cost_model(
            merged(current.model_dump(mode="json"), change), prefix=prefix
        ),
        actor=actor,
    )


def _save(environment: Environment, new_model, *, actor: Actor):
    """Write the model; when its pricing changed and the gate policy in force
    prices a check with it, that counts as a gate-policy change (its version is
    bumped in the same transaction), so an approval re-checks the stored
    evidence against the new prices."""
    with transaction.atomic():
        Environment.objects.select_for_update().get(pk=environment.pk)
        before = cost_model_for(environment).pricing
        row = save_environment_spec(
            environment,
            current=cost_model_for,
            new_spec=new_model,
            row_model=EnvironmentCostModel,
            field="spec_json",
            verb="environment.cost_model_set",
            key="cost_model",
            actor=actor,
        )
        if row.spec.pricing != before and prices_with_cost_model(
            gate_policy_for(environment)
        ):
            do_bump_gate_policy_version(
                environment,
                actor=actor,
                why="the cost model its cost checks price with changed",
            )
    return row
