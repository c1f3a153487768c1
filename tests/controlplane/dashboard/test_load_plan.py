"""The load-plan page: members read the plan, the team's admins edit it as JSON
(the error names the bad field, nothing is saved), outsiders see nothing."""

import json

from controlplane.audit.models import AuditEvent
from controlplane.loadplans.actions import load_plan_for
from gpuagent.protocol import default_load_plan


def url(environment) -> str:
    return f"/environments/{environment.pk}/load-plan/"


def test_an_admin_edits_the_plan_as_json(client, owner, environment):
    client.force_login(owner)
    page = client.get(url(environment))
    assert page.status_code == 200
    assert 'id="load-plan-form"' in page.content.decode()
    assert page.context["is_default"] is True
    plan = json.loads(page.context["text"])
    plan["budget_s"] = 42

    response = client.post(url(environment), {"plan": json.dumps(plan)}, follow=True)

    assert response.status_code == 200
    assert "Saved the load plan of acme/staging." in response.content.decode()
    assert load_plan_for(environment).budget_s == 42
    event = AuditEvent.objects.get(verb="environment.load_plan_set")
    assert event.actor_name == "alice"


def test_a_bad_plan_is_shown_again_with_the_field_named(client, owner, environment):
    client.force_login(owner)
    plan = default_load_plan().model_dump(mode="json")
    plan["sweeps"]["concurrency"]["knee"] = 4

    response = client.post(url(environment), {"plan": json.dumps(plan)})
    not_json = client.post(url(environment), {"plan": "{budget_s: 1"})

    assert response.status_code == 422
    body = response.content.decode()
    assert "sweeps.concurrency.knee: Extra inputs are not permitted" in body
    assert "&quot;knee&quot;: 4" in body  # what was typed, to fix
    assert not_json.status_code == 422
    assert "not JSON" in not_json.content.decode()
    assert load_plan_for(environment) == default_load_plan()


def test_a_member_reads_it_and_may_not_change_it(client, teammate, environment):
    client.force_login(teammate)

    page = client.get(url(environment))
    refused = client.post(url(environment), {"plan": "{}"})

    assert page.status_code == 200
    assert 'id="load-plan-form"' not in page.content.decode()
    assert "Only the team's admins change it." in page.content.decode()
    assert refused.status_code == 403
    assert load_plan_for(environment) == default_load_plan()


def test_an_outsider_sees_nothing(client, outsider, environment):
    client.force_login(outsider)

    assert client.get(url(environment)).status_code == 404
