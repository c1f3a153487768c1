"""GET/PUT/PATCH /api/v1/environments/{id}/load-plan: the default until one is set,
PUT states the whole plan, PATCH changes what it names, unknown keys refused by
name, audited with both plans; the plan in force travels in the load_test job."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.loadplans.actions import load_plan_for
from controlplane.releases.actions.jobs import do_dispatch_job
from controlplane.releases.stages import request_for
from gpuagent.protocol import LoadPlan, default_load_plan
from tests.controlplane.api.helpers import error_of, field_names

PLAN = {
    "workloads": [
        {
            "name": "chat-ko",
            "task": "chat",
            "language": "ko",
            "prompt": {"tokens": 200, "spread": 0.5},
            "output": {"tokens": 64},
            "session": {"turns": 6, "system_prompt_tokens": 400, "think_time_s": 2},
            "slo_ttft_p99_ms": 800,
        }
    ],
    "sweeps": {"concurrency": {"mode": "stepped", "levels": [1, 4, 16]}},
    "budget_s": 600,
}


def url(environment_id) -> str:
    return f"/api/v1/environments/{environment_id}/load-plan"


def send(api, environment, body, token, method="put"):
    return getattr(api.client, method)(
        url(environment.pk),
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


def test_it_shows_the_default_plan_until_one_is_set(api, owner_token, environment):
    response = api.get(url(environment.pk), token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["is_default"] is True
    assert data["load_plan"] == default_load_plan().model_dump(mode="json")


def test_an_admin_sets_a_plan_and_the_change_is_audited(api, admin_token, environment):
    response = send(api, environment, PLAN, admin_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["is_default"] is False
    assert data["load_plan"]["workloads"][0]["session"]["turns"] == 6
    assert data["load_plan"]["sweeps"]["rates"] is None  # left out: the default
    assert load_plan_for(environment) == LoadPlan.model_validate(PLAN)
    event = AuditEvent.objects.get(verb="environment.load_plan_set")
    assert event.before["load_plan"] == default_load_plan().model_dump(mode="json")
    assert event.after["load_plan"] == data["load_plan"]
    assert "budget_s" in event.after["changed"]


def test_a_patch_keeps_what_it_does_not_name(api, admin_token, environment):
    send(api, environment, PLAN, admin_token)

    response = send(
        api,
        environment,
        {"budget_s": 120, "sweeps": {"rates": {"rates": [1, 2]}}},
        admin_token,
        method="patch",
    )

    assert response.status_code == 200, response.content
    plan = load_plan_for(environment)
    assert plan.budget_s == 120
    assert plan.sweeps.rates.rates == [1, 2]
    assert plan.sweeps.concurrency.levels == [1, 4, 16]  # kept
    assert [w.name for w in plan.workloads] == ["chat-ko"]  # kept
    change = AuditEvent.objects.filter(verb="environment.load_plan_set").latest("id")
    assert "budget_s" in change.after["changed"]
    assert "sweeps.rates" in change.after["changed"]
    assert "workloads" not in change.after["changed"]


def test_a_patch_of_the_default_plan_changes_the_default_plan(
    api, admin_token, environment
):
    response = send(api, environment, {"budget_s": 45}, admin_token, method="patch")

    assert response.status_code == 200, response.content
    assert load_plan_for(environment) == default_load_plan().model_copy(
        update={"budget_s": 45.0}
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"budget": 60}, "budget"),
        ({"budget_s": -1}, "budget_s"),
        ({"sweeps": {"concurrency": {"knee": True}}}, "sweeps.concurrency.knee"),
        ({"sweeps": {"rates": {"rates": []}}}, "sweeps.rates.rates"),
        ({"workloads": [{"name": "x"}]}, "workloads.0.task"),
    ],
)
def test_it_names_the_field_it_refuses_and_keeps_what_was_there(
    api, admin_token, environment, body, field
):
    send(api, environment, PLAN, admin_token)

    put = send(api, environment, {**PLAN, **body}, admin_token)
    patch = send(api, environment, body, admin_token, method="patch")

    assert put.status_code == 422, put.content
    assert any(f.startswith(field) for f in field_names(put.json()["error"]))
    assert patch.status_code == 422, patch.content
    patched = patch.json()["error"]
    assert any(f.startswith(field) for f in field_names(patched)), patched
    assert load_plan_for(environment) == LoadPlan.model_validate(PLAN)
    assert AuditEvent.objects.filter(verb="environment.load_plan_set").count() == 1


def test_a_patch_names_a_change(api, admin_token, environment):
    error = error_of(
        send(api, environment, {}, admin_token, method="patch"),
        422,
        "validation_error",
    )

    assert "name at least one key" in error["fields"][0]["message"]


def test_it_needs_the_admin_scope_and_role(
    api, make_token, owner_token, teammate, outsider_token, environment
):
    error = error_of(send(api, environment, PLAN, owner_token), 403, "missing_scope")
    assert error["scope"] == "admin"
    approver_admin_scope = make_token(teammate, "admin")
    error_of(send(api, environment, PLAN, approver_admin_scope), 403, "forbidden")
    error_of(send(api, environment, PLAN, outsider_token), 404, "not_found")
    assert load_plan_for(environment) == default_load_plan()


def test_the_load_test_job_carries_the_plan_in_force(
    api, admin_token, environment, release
):
    send(api, environment, PLAN, admin_token)

    load_test = request_for(do_dispatch_job(release, "load_test"))
    evaluate = request_for(do_dispatch_job(release, "evaluate"))

    assert load_test.load_plan == LoadPlan.model_validate(PLAN)
    assert evaluate.load_plan is None
