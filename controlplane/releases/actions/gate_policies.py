"""An environment's gate policy: replaced whole (PUT) or changed key by key (PATCH).

Either way a key the caller leaves out never turns a check off: on a replacement it
takes its default, on a change it keeps its current value. Only an explicit null
turns a threshold (or `quality`, `load`, `capacity`) off. Every write is audited
with both whole policies and the dotted keys that changed.
"""

from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models import F
from pydantic import BaseModel, ValidationError

from controlplane.accounts.actions import check_actor_in_team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import ValidationFailed, validation_failed
from controlplane.fleet.models import Environment
from controlplane.releases.gates import GatePolicy
from controlplane.releases.models import EnvironmentGatePolicy


def gate_policy_for(environment: Environment) -> GatePolicy:
    """The environment's gate policy; the default GatePolicy() when none is set."""
    return gate_policy_in_force(environment)[0]


def gate_policy_in_force(environment: Environment) -> tuple[GatePolicy, int]:
    """(the environment's gate policy, its version), read from one row: version 0
    is the default GatePolicy() of an environment that never set one."""
    row = EnvironmentGatePolicy.objects.filter(environment=environment).first()
    return (row.spec, row.version) if row is not None else (GatePolicy(), 0)


def check_gate_policy(policy: Any, *, prefix: str = "policy") -> GatePolicy:
    """`policy` (GatePolicy's JSON) validated; ValidationFailed names the first bad
    field under `prefix`, e.g. policy.quality.thresholds.max_kld."""
    if not isinstance(policy, dict):
        raise ValidationFailed(f"{prefix}: must be a JSON object", field=prefix)
    try:
        return GatePolicy.model_validate(policy)
    except ValidationError as exc:
        raise validation_failed(exc, prefix) from exc


def merged(current: Any, change: Any) -> Any:
    """`change` applied to `current` as a JSON merge patch (RFC 7396), except that
    null is a value, not a removal: an object merges key by key, anything else
    (a number, a list, null) replaces."""
    if not isinstance(change, dict):
        return change
    base = dict(current) if isinstance(current, dict) else {}
    for key, value in change.items():
        base[key] = merged(base.get(key), value)
    return base


def changed_keys(before: Any, after: Any, path: str = "") -> list[str]:
    """The dotted keys whose values differ between two policies' JSON."""
    if isinstance(before, dict) and isinstance(after, dict):
        keys = sorted(set(before) | set(after))
        return [
            changed
            for key in keys
            for changed in changed_keys(
                before.get(key), after.get(key), f"{path}.{key}" if path else key
            )
        ]
    return [] if before == after else [path]


def do_set_gate_policy(
    environment: Environment, policy: dict, *, actor: Actor
) -> EnvironmentGatePolicy:
    """Replace the environment's gate policy (admin role; a token needs the admin
    scope): a key `policy` leaves out takes its default."""
    check_actor_in_team(actor, environment.team, scope="admin", roles=("admin",))
    spec = check_gate_policy(policy)
    return _save(environment, lambda _: spec, actor=actor)


def do_update_gate_policy(
    environment: Environment, change: dict, *, actor: Actor, prefix: str = "policy"
) -> EnvironmentGatePolicy:
    """Change the named keys of the environment's gate policy (see `merged`); the
    others keep their current values. Read and written under the environment's row
    lock, so two changes at once both count."""
    check_actor_in_team(actor, environment.team, scope="admin", roles=("admin",))
    if not isinstance(change, dict):
        raise ValidationFailed(f"{prefix}: must be a JSON object", field=prefix)
    return _save(
        environment,
        lambda current: check_gate_policy(
            merged(current.model_dump(mode="json"), change), prefix=prefix
        ),
        actor=actor,
    )


def _save(environment: Environment, new_policy, *, actor: Actor):
    """Write the policy and bump its version, in one transaction (the
    environment's row lock, taken by save_environment_spec, is held to the end)."""
    with transaction.atomic():
        row = save_environment_spec(
            environment,
            current=gate_policy_for,
            new_spec=new_policy,
            row_model=EnvironmentGatePolicy,
            field="policy",
            verb="environment.gate_policy_set",
            key="policy",
            actor=actor,
        )
        EnvironmentGatePolicy.objects.filter(pk=row.pk).update(version=F("version") + 1)
        row.refresh_from_db(fields=["version"])
    return row


def do_bump_gate_policy_version(
    environment: Environment, *, actor: Actor, why: str
) -> EnvironmentGatePolicy:
    """Count a change outside the policy that can change its outcomes (`why`: the
    cost model its cost checks price with) as a policy change: its version goes
    up, so an approval holds the stored evidence against it again
    (gate_results.do_recheck_release_gates). An environment on the default
    policy gets a row holding it. Call under the environment's row lock, in the
    transaction of that change."""
    with transaction.atomic():
        row, _ = EnvironmentGatePolicy.objects.get_or_create(
            environment=environment,
            defaults={"policy": GatePolicy().model_dump(mode="json")},
        )
        EnvironmentGatePolicy.objects.filter(pk=row.pk).update(version=F("version") + 1)
        row.refresh_from_db(fields=["version"])
        do_record_event(
            actor,
            "environment.gate_policy_version_bumped",
            environment,
            after={"version": row.version, "why": why},
            team=environment.team,
        )
    return row


def save_environment_spec(
    environment: Environment,
    *,
    current: Callable[[Environment], BaseModel],
    new_spec: Callable[[BaseModel], BaseModel],
    row_model,
    field: str,
    verb: str,
    key: str,
    actor: Actor,
):
    """Write one environment's JSON spec (its gate policy, its cost model) as
    `new_spec(current spec)` into `row_model`'s `field`, under the environment's
    row lock so two changes at once both count, with one `verb` audit event
    holding both whole specs under `key` and the dotted keys that changed."""
    with transaction.atomic():
        Environment.objects.select_for_update().get(pk=environment.pk)
        spec_before = current(environment)
        spec = new_spec(spec_before)
        before = spec_before.model_dump(mode="json")
        after = spec.model_dump(mode="json")
        row, _ = row_model.objects.update_or_create(
            environment=environment, defaults={field: after}
        )
        do_record_event(
            actor,
            verb,
            environment,
            before={key: before},
            after={key: after, "changed": changed_keys(before, after)},
            team=environment.team,
        )
    return row
