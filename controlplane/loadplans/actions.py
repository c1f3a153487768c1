"""An environment's load-test plan: replaced whole (PUT) or changed key by key
(PATCH), with the cost model's and gate policy's semantics (releases.actions.
gate_policies): an object merges key by key, anything else (a list, a number,
null) replaces, so `{"budget_s": 60}` changes the budget and keeps the workloads.
Every write is one audited event (`environment.load_plan_set`) with both whole
plans and the dotted keys that changed. The plan in force travels in each
load_test job's request (`releases.stages.request_for`) and comes back in its
report."""

from typing import Any

from pydantic import ValidationError

from controlplane.accounts.actions import check_manage_team
from controlplane.audit.actions import Actor
from controlplane.errors import ValidationFailed, validation_failed
from controlplane.fleet.models import Environment
from controlplane.loadplans.models import EnvironmentLoadPlan
from controlplane.releases.actions.gate_policies import (
    merged,
    save_environment_spec,
)
from gpuagent.protocol import LoadPlan, default_load_plan


def load_plan_of(environment: Environment) -> tuple[LoadPlan, bool]:
    """(the environment's plan, True when none is set and it is the default)."""
    row = EnvironmentLoadPlan.objects.filter(environment=environment).first()
    return (row.spec, False) if row is not None else (default_load_plan(), True)


def load_plan_for(environment: Environment) -> LoadPlan:
    """The plan a load test in `environment` runs."""
    return load_plan_of(environment)[0]


def check_load_plan(spec: Any, *, prefix: str = "load_plan") -> LoadPlan:
    """`spec` (LoadPlan's JSON) validated; ValidationFailed names the first bad
    field under `prefix`, e.g. load_plan.sweeps.concurrency.levels."""
    if not isinstance(spec, dict):
        where = prefix or "body"
        raise ValidationFailed(f"{where}: must be a JSON object", field=prefix)
    try:
        return LoadPlan.model_validate(spec)
    except ValidationError as exc:
        raise validation_failed(exc, prefix) from exc


def do_set_load_plan(
    environment: Environment, spec: dict, *, actor: Actor, prefix: str = "load_plan"
) -> EnvironmentLoadPlan:
    """Replace the environment's plan (the team's admin; a token needs the admin
    scope)."""
    check_manage_team(actor, environment.team)
    plan = check_load_plan(spec, prefix=prefix)
    return _save(environment, lambda _: plan, actor=actor)


def do_update_load_plan(
    environment: Environment, change: dict, *, actor: Actor, prefix: str = "load_plan"
) -> EnvironmentLoadPlan:
    """Change the named keys of the environment's plan (the default's when none is
    set); read and written under the environment's row lock."""
    check_manage_team(actor, environment.team)
    if not isinstance(change, dict) or not change:
        raise ValidationFailed(
            f"{prefix or 'body'}: name at least one key to change", field=prefix
        )
    return _save(
        environment,
        lambda current: check_load_plan(
            merged(current.model_dump(mode="json"), change), prefix=prefix
        ),
        actor=actor,
    )


def _save(environment: Environment, new_plan, *, actor: Actor):
    return save_environment_spec(
        environment,
        current=load_plan_for,
        new_spec=new_plan,
        row_model=EnvironmentLoadPlan,
        field="spec_json",
        verb="environment.load_plan_set",
        key="load_plan",
        actor=actor,
    )
