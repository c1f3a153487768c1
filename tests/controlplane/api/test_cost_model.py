"""GET/PUT/PATCH /api/v1/environments/{id}/cost-model: the gate policy's semantics
(PUT states the whole model, PATCH changes what it names), strict types, audited."""

from decimal import Decimal

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.costs.actions import cost_model_for
from controlplane.costs.spec import CostModel
from tests.controlplane.api.helpers import error_of, field_names

KRW = {
    "currency": "KRW",
    "device_hourly_price": "4500",
    "power_draw_w": "700",
    "electricity_price_per_kwh": "120.5",
    "target_requests_per_s": {"chat": 20, "rag": 2.5},
    "note": "example price",
}


def url(environment_id) -> str:
    return f"/api/v1/environments/{environment_id}/cost-model"


def send(api, environment, body, token, method="put"):
    return getattr(api.client, method)(
        url(environment.pk),
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


def test_it_shows_the_default_with_a_warning_until_one_is_set(
    api, owner_token, environment
):
    response = api.get(url(environment.pk), token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["is_default"] is True and data["priced"] is False
    assert data["cost_model"]["currency"] == "USD"
    assert data["device_hour_cost"] == "0"
    assert "No device price is set for acme/staging" in data["warnings"][0]


def test_an_admin_sets_a_price_in_krw_with_power(api, admin_token, environment):
    """4,500 KRW a device-hour plus 700 W at 120.5 KRW per kWh (84.35 KRW)."""
    response = send(api, environment, KRW, admin_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["is_default"] is False and data["priced"] is True
    assert Decimal(data["device_hour_cost"]) == Decimal("4584.35")
    assert data["cost_model"]["device_hourly_price"] == "4500"
    assert data["cost_model"]["target_requests_per_s"] == {"chat": 20.0, "rag": 2.5}
    assert data["warnings"] == []
    model = cost_model_for(environment)
    assert model.electricity_price_per_kwh == Decimal("120.5")
    event = AuditEvent.objects.get(verb="environment.cost_model_set")
    prefix = event.actor_token.prefix
    assert event.actor_name == f"token:{prefix} (alice-read-admin, alice)"
    assert event.before["cost_model"] == CostModel().model_dump(mode="json")
    assert event.after["cost_model"]["currency"] == "KRW"
    assert "device_hourly_price" in event.after["changed"]


def test_a_put_states_the_whole_model(api, admin_token, environment):
    send(api, environment, KRW, admin_token)

    response = send(
        api, environment, {"currency": "USD", "device_hourly_price": 2.49}, admin_token
    )

    assert response.status_code == 200, response.content
    model = cost_model_for(environment)
    assert model.device_hourly_price == Decimal("2.49")
    assert model.power_draw_w is None  # left out: the default, not the old value
    assert model.target_requests_per_s == {}
    unstated = send(api, environment, {"currency": "USD"}, admin_token)
    error = error_of(unstated, 422, "validation_error")
    assert field_names(error) == {"device_hourly_price"}


def test_a_patch_changes_only_the_keys_it_names(api, admin_token, environment):
    send(api, environment, KRW, admin_token)

    response = send(
        api,
        environment,
        {"target_requests_per_s": {"code": 4}, "note": "list price"},
        admin_token,
        method="patch",
    )

    assert response.status_code == 200, response.content
    model = cost_model_for(environment)
    assert model.target_requests_per_s == {"chat": 20, "rag": 2.5, "code": 4}
    removed = send(
        api,
        environment,
        {"target_requests_per_s": {"rag": None}},
        admin_token,
        method="patch",
    )
    assert removed.json()["cost_model"]["target_requests_per_s"] == {
        "chat": 20,
        "code": 4,
    }
    assert (model.currency, model.note) == ("KRW", "list price")
    first_change = AuditEvent.objects.filter(verb="environment.cost_model_set")[1]
    assert first_change.after["changed"] == ["note", "target_requests_per_s.code"]
    cleared = send(
        api,
        environment,
        {"power_draw_w": None, "electricity_price_per_kwh": None},
        admin_token,
        method="patch",
    )
    assert cleared.status_code == 200, cleared.content
    assert cost_model_for(environment).pricing.device_hour_cost == Decimal("4500")
    half = send(api, environment, {"power_draw_w": "300"}, admin_token, method="patch")
    error = error_of(half, 422, "validation_failed")
    assert field_names(error) == {"electricity_price_per_kwh"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"device_hourly_price": True}, "device_hourly_price"),
        ({"device_hourly_price": "2.5 USD"}, "device_hourly_price"),
        (
            {"currency": "KRW", "device_hourly_price": "4500.123456"},
            "device_hourly_price",
        ),
        ({"currency": "XXX"}, "currency"),
        ({"devices_per_replica": 0}, "devices_per_replica"),
        ({"target_requests_per_s": {"chat": -1}}, "target_requests_per_s.chat"),
        ({"gpu_price": "2"}, "gpu_price"),
    ],
)
def test_it_names_the_field_it_refuses_and_keeps_what_was_there(
    api, admin_token, environment, body, field
):
    send(api, environment, KRW, admin_token)

    put = send(api, environment, {**KRW, **body}, admin_token)
    patch = send(api, environment, body, admin_token, method="patch")

    assert field in field_names(error_of(put, 422, "validation_error"))
    patched = patch.json()["error"]
    assert patch.status_code == 422 and field in field_names(patched), patched
    assert cost_model_for(environment).device_hourly_price == Decimal("4500")
    assert AuditEvent.objects.filter(verb="environment.cost_model_set").count() == 1


def test_a_patch_names_a_change(api, admin_token, environment):
    error = error_of(
        send(api, environment, {}, admin_token, method="patch"),
        422,
        "validation_error",
    )

    assert "name at least one key" in error["fields"][0]["message"]


def test_it_needs_the_admin_scope_and_role(
    api, make_token, owner_token, teammate, environment
):
    error = error_of(send(api, environment, KRW, owner_token), 403, "missing_scope")
    assert error["scope"] == "admin"
    approver_admin_scope = make_token(teammate, "admin")
    error_of(send(api, environment, KRW, approver_admin_scope), 403, "forbidden")
    assert cost_model_for(environment) == CostModel()


def test_it_hides_another_teams_environment(
    api, outsider_token, admin_token, environment, make_environment, other_team
):
    theirs = make_environment("staging", of_team=other_team)

    error_of(send(api, environment, KRW, outsider_token), 404, "not_found")
    error_of(api.get(url(environment.pk), token=outsider_token), 404, "not_found")
    own = send(api, theirs, KRW, outsider_token)
    assert own.status_code == 200, own.content  # the same call in its own team
    error_of(send(api, theirs, KRW, admin_token), 404, "not_found")
