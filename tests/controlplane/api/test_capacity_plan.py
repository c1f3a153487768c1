"""GET /api/v1/releases/{id}/capacity-plan: unit costs and devices against live."""

from decimal import Decimal

import pytest

from controlplane.costs.capacity import capacity_plan
from controlplane.costs.money import Pricing
from controlplane.costs.report import economics
from controlplane.fleet.actions import do_register_agent
from controlplane.releases.gates import GatePolicy
from tests.controlplane.api.helpers import error_of, field_names
from tests.controlplane.dashboard.builders import (
    load_test_report,
    set_price,
    take_live,
    to_awaiting_approval,
)


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}/capacity-plan"


@pytest.fixture
def scene(db, make_release, owner, teammate, environment):
    """staging priced at 4,500 KRW a device-hour, planning chat 30 req/s and rag
    3 req/s; 0.9.0 live there, 1.0.0 (faster) waiting for approval."""
    agent = do_register_agent("gpu-a1", queue="agent.gpu-a1")
    set_price(
        environment,
        owner,
        "4500",
        currency="KRW",
        target_requests_per_s={"chat": 30.0, "rag": 3.0},
    )
    live = to_awaiting_approval(make_release("0.9.0"), agent=agent, speed=0.8)
    take_live(live, teammate, agent=agent)
    candidate = to_awaiting_approval(make_release("1.0.0"), agent=agent, speed=1.3)
    return candidate, live


def test_it_plans_the_candidate_against_live(api, owner_token, scene):
    candidate, live = scene

    response = api.get(url(candidate.pk), token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["live_release_id"], data["currency"]) == (live.pk, "KRW")
    assert data["targets"] == {"chat": 30.0, "rag": 3.0}
    assert data["targets_source"] == "environment"
    pricing = Decimal("4500")
    expected = capacity_plan(
        {"chat": 30.0, "rag": 3.0},
        load_test_report(candidate.recipe, speed=1.3),
        load_test_report(live.recipe, speed=0.8),
        GatePolicy().slo_of,
        Pricing("KRW", pricing),
        has_live=True,
    )
    for row, plan in zip(data["plan"], expected.rows, strict=True):
        assert row["workload"] == plan.workload
        assert row["candidate"]["devices"] == plan.candidate.devices
        assert row["live"]["devices"] == plan.live.devices
        assert row["device_difference"] == plan.device_difference
        assert Decimal(row["monthly_cost_difference"]) == plan.monthly_difference
        assert "." not in row["candidate"]["monthly_cost"]  # whole won
    assert data["total"]["workload"] == "all (one shared pool)"
    chat = next(w for w in data["workloads"] if w["workload"] == "chat")
    mine = economics(
        load_test_report(candidate.recipe, speed=1.3),
        GatePolicy(),
        Pricing("KRW", pricing),
    )["chat"]
    assert Decimal(chat["cost_per_request"]) == mine.costs.cost_per_request
    assert chat["max_concurrency_at_slo"] == mine.knee
    assert {w["workload"] for w in data["live_workloads"]} == {"chat", "rag", "code"}
    parts = {part["what"]: part for part in data["verification"]["parts"]}
    assert set(parts) == {"integrity", "quality", "load"}
    load_test = candidate.jobs.get(kind="load_test")
    assert parts["load"]["seconds"] == round(load_test.duration_s, 3)
    assert Decimal(parts["load"]["cost"]) == Pricing("KRW", pricing).agent_time(
        load_test.duration_s
    )


def test_it_plans_the_traffic_the_caller_names(api, owner_token, scene):
    candidate, _ = scene

    response = api.get(url(candidate.pk), token=owner_token, targets="code:2.5")

    data = response.json()
    assert data["targets"] == {"code": 2.5}
    assert data["targets_source"] == "request"
    assert [row["workload"] for row in data["plan"]] == ["code"]


@pytest.mark.parametrize("targets", ["chat", "chat:0", "chat:1,chat:2", "chat:x"])
def test_it_names_bad_targets(api, owner_token, scene, targets):
    candidate, _ = scene

    response = api.get(url(candidate.pk), token=owner_token, targets=targets)

    assert field_names(error_of(response, 422, "validation_error")) == {"targets"}


def test_the_live_release_is_not_compared_with_itself(api, owner_token, scene):
    _, live = scene

    data = api.get(url(live.pk), token=owner_token).json()

    assert data["live_release_id"] is None
    assert all(row["live"] is None for row in data["plan"])


def test_it_warns_instead_of_pricing_at_zero(api, owner_token, make_release, db):
    release = make_release("1.0.0")

    data = api.get(url(release.pk), token=owner_token).json()

    assert "No device price is set" in data["warnings"][0]
    assert data["workloads"] == [] and data["plan"] == []
    assert data["verification"]["cost"] is None


def test_it_hides_another_teams_release(api, outsider_token, scene):
    candidate, _ = scene

    error_of(api.get(url(candidate.pk), token=outsider_token), 404, "not_found")
