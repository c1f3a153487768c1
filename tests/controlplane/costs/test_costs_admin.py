"""The Django admin edits a cost model through the action: validated, checked
against the signed-in operator, audited."""

import json

from django.contrib.auth.models import Permission, User

from controlplane.audit.models import AuditEvent
from controlplane.costs.actions import cost_model_for
from controlplane.costs.spec import CostModel
from tests.controlplane.conftest import PASSWORD

ADD = "/admin/costs/environmentcostmodel/add/"


def add(client, environment, spec):
    return client.post(
        ADD, {"environment": environment.pk, "spec_json": json.dumps(spec)}
    )


def test_it_sets_a_cost_model_as_the_signed_in_operator(
    admin_client, admin_user, environment
):
    response = add(
        admin_client,
        environment,
        {"currency": "KRW", "device_hourly_price": "4500", "note": "list price"},
    )

    assert response.status_code == 302, response.content.decode()[-2000:]
    assert str(cost_model_for(environment).device_hourly_price) == "4500"
    event = AuditEvent.objects.get(verb="environment.cost_model_set")
    assert event.actor_user == admin_user
    assert event.after["cost_model"]["note"] == "list price"


def test_it_names_what_is_wrong_and_saves_nothing(admin_client, environment):
    response = add(
        admin_client, environment, {"currency": "KRW", "device_hourly_price": "0.12345"}
    )

    assert response.status_code == 200
    assert "device_hourly_price: at most 4 decimals in KRW" in response.content.decode()
    assert cost_model_for(environment) == CostModel()
    assert not AuditEvent.objects.filter(verb="environment.cost_model_set").exists()


def test_staff_outside_the_team_may_not(client, environment):
    staff = User.objects.create_user("sam", password=PASSWORD, is_staff=True)
    staff.user_permissions.set(
        Permission.objects.filter(codename__endswith="environmentcostmodel")
    )
    client.force_login(staff)

    refused = add(client, environment, {"device_hourly_price": "2"})

    assert refused.status_code == 200
    assert "not a member of team acme" in refused.content.decode()
    assert cost_model_for(environment) == CostModel()
