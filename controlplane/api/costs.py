"""Money and capacity: an environment's cost model (GET/PUT/PATCH, the gate policy's
semantics) and a release's unit costs and capacity plan against the live release."""

from django.http import HttpRequest
from ninja import Query, Router

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    CapacityPlanOut,
    CapacityPlanQuery,
    CostModelChangeIn,
    CostModelIn,
    CostModelOut,
    ObjectId,
)
from controlplane.api.scoping import get_environment, get_release, principal_of
from controlplane.costs.actions import (
    cost_model_of,
    do_set_cost_model,
    do_update_cost_model,
)
from controlplane.costs.capacity import PlanRow, Side
from controlplane.costs.money import HOURS_PER_MONTH
from controlplane.costs.report import parse_targets, pricing_warnings, release_costs
from controlplane.fleet.models import Environment

router = Router(tags=["cost and capacity"])


def cost_model_dict(environment: Environment) -> dict:
    model, is_default = cost_model_of(environment)
    return {
        "environment": environment.name,
        "cost_model": model.model_dump(mode="json"),
        "is_default": is_default,
        "device_hour_cost": model.pricing.device_hour_cost,
        "priced": model.pricing.priced,
        "warnings": pricing_warnings(environment, model, is_default),
    }


@router.get(
    "/environments/{environment_id}/cost-model",
    auth=read_auth(),
    response={200: CostModelOut, **READ_ERRORS},
    summary="The environment's cost model (a device-hour at 0 until one is set)",
)
def get_cost_model(request: HttpRequest, environment_id: ObjectId) -> dict:
    return cost_model_dict(get_environment(principal_of(request), environment_id))


@router.put(
    "/environments/{environment_id}/cost-model",
    auth=token_auth("admin"),
    response={200: CostModelOut, **WRITE_ERRORS},
    summary="Replace the environment's cost model (admin role)",
    description="The body is the whole model: `currency` and `device_hourly_price` "
    "(a decimal string, e.g. '2.49', or a JSON number) are required, any other "
    "key left out takes its default. Audited (`environment.cost_model_set`). "
    "README: Cost and capacity.",
)
def put_cost_model(
    request: HttpRequest, environment_id: ObjectId, payload: CostModelIn
) -> dict:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    do_set_cost_model(
        environment, payload.model_dump(mode="json"), actor=principal.token, prefix=""
    )
    return cost_model_dict(environment)


@router.patch(
    "/environments/{environment_id}/cost-model",
    auth=token_auth("admin"),
    response={200: CostModelOut, **WRITE_ERRORS},
    summary="Change keys of the environment's cost model (admin role)",
    description="Only the keys the body names change; `target_requests_per_s` "
    "merges workload by workload (null removes one); null clears an optional key. "
    "Audited. README: Cost and capacity.",
)
def patch_cost_model(
    request: HttpRequest, environment_id: ObjectId, payload: CostModelChangeIn
) -> dict:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    do_update_cost_model(
        environment,
        payload.model_dump(mode="json", exclude_unset=True),
        actor=principal.token,
        prefix="",
    )
    return cost_model_dict(environment)


def _side(side: Side | None) -> dict | None:
    if side is None:
        return None
    return {
        "requests_per_s_per_replica": side.requests_per_s_per_replica,
        "replicas": side.replicas,
        "devices": side.devices,
        "monthly_cost": side.monthly_cost,
        "missing": side.missing,
    }


def plan_row_dict(row: PlanRow) -> dict:
    return {
        "workload": row.workload,
        "target_requests_per_s": row.target_requests_per_s,
        "candidate": _side(row.candidate),
        "live": _side(row.live),
        "device_difference": row.device_difference,
        "monthly_cost_difference": row.monthly_difference,
    }


@router.get(
    "/releases/{release_id}/capacity-plan",
    auth=read_auth(),
    response={200: CapacityPlanOut, **READ_ERRORS},
    summary="A release's unit costs and the devices it needs vs the live release",
    description="Each workload at its SLO (the gate policy's latency thresholds), "
    "priced with the environment's cost model; for the target traffic (`targets`, "
    "else the cost model's) the replicas, devices and money per month of this "
    "release and of the one live in its environment, and the difference; and the "
    "agent time its checks took, priced. README: Cost and capacity.",
)
def get_capacity_plan(
    request: HttpRequest, release_id: ObjectId, query: Query[CapacityPlanQuery]
) -> dict:
    release = get_release(principal_of(request), release_id)
    targets = parse_targets(query.targets) if query.targets is not None else None
    costs = release_costs(release, targets=targets)
    live = costs.live_release
    plan = costs.plan
    return {
        "release_id": release.pk,
        "release": str(release),
        "environment": release.target_environment.name,
        "live_release_id": live.pk if live else None,
        "live_release": str(live) if live else None,
        "currency": costs.currency,
        "device_hour_cost": costs.env.pricing.device_hour_cost,
        "cost_model_note": costs.env.cost_model.note,
        "hours_per_month": int(HOURS_PER_MONTH),
        "warnings": costs.env.warnings,
        "notes": costs.notes,
        "problems": costs.problems,
        "targets": costs.targets,
        "targets_source": costs.targets_source,
        "workloads": [w.to_dict() for w in costs.workloads.values()],
        "live_workloads": [w.to_dict() for w in costs.live_workloads.values()],
        "plan": [plan_row_dict(row) for row in plan.rows] if plan else [],
        "total": plan_row_dict(plan.total) if plan and plan.total else None,
        "verification": costs.verification.to_dict(),
    }
