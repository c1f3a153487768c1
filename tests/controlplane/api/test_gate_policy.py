import pytest

from controlplane.audit.models import AuditEvent
from controlplane.releases.actions.gate_policies import gate_policy_for
from controlplane.releases.gates import GatePolicy
from tests.controlplane.api.helpers import error_of, field_names

NOTHING_GATED = {"quality": None, "load": None}


def url(environment_id) -> str:
    return f"/api/v1/environments/{environment_id}/gate-policy"


@pytest.fixture
def admin_token(make_token, owner):
    return make_token(owner, "read", "admin")


def put(api, environment, body, token):
    return api.client.put(
        url(environment.pk),
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


def test_it_shows_the_default_until_one_is_set(api, owner_token, environment):
    response = api.get(url(environment.pk), token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["is_default"] is True
    assert data["policy"] == GatePolicy().model_dump(mode="json")
    assert data["policy"]["quality"]["thresholds"]["max_mean_kld"] == 0.03


def test_an_admin_sets_thresholds_and_the_gate_uses_them(api, admin_token, environment):
    body = {
        "quality": {"thresholds": {"max_mean_kld": 0.002, "min_same_top1": 0.975}},
        "load": {
            "workloads": ["chat"],
            "capacity": {"min_sessions": 16, "context_tokens": 8192},
        },
    }

    response = put(api, environment, body, admin_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["is_default"] is False
    policy = gate_policy_for(environment)
    assert policy.quality.thresholds.max_mean_kld == 0.002
    assert policy.quality.thresholds.max_ppl_ratio is None  # replaced as a whole
    assert policy.load.capacity.min_sessions == 16
    event = AuditEvent.objects.get(verb="environment.gate_policy_set")
    assert event.after["policy"]["load"]["workloads"] == ["chat"]


def test_it_names_an_unknown_or_bad_threshold(api, admin_token, environment):
    response = put(
        api,
        environment,
        {"quality": {"thresholds": {"max_kld": 1}}, "load": None},
        admin_token,
    )

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"quality.thresholds.max_kld"}
    bad = put(
        api,
        environment,
        {"quality": None, "load": {"thresholds": {"max_ttft_p99_ms": -1}}},
        admin_token,
    )
    assert field_names(error_of(bad, 422, "validation_error")) == {
        "load.thresholds.max_ttft_p99_ms"
    }
    unstated = put(api, environment, {}, admin_token)
    assert field_names(error_of(unstated, 422, "validation_error")) == {
        "quality",
        "load",
    }
    assert gate_policy_for(environment) == GatePolicy()


def test_it_needs_the_admin_scope_and_role(
    api, make_token, owner_token, teammate, environment
):
    error = error_of(
        put(api, environment, NOTHING_GATED, owner_token), 403, "missing_scope"
    )
    assert error["scope"] == "admin"
    approver_admin_scope = make_token(teammate, "admin")
    error_of(
        put(api, environment, NOTHING_GATED, approver_admin_scope), 403, "forbidden"
    )


def test_it_hides_another_teams_environment(api, outsider_token, environment):
    error_of(put(api, environment, NOTHING_GATED, outsider_token), 404, "not_found")
    error_of(api.get(url(environment.pk), token=outsider_token), 404, "not_found")


def test_it_sets_automatic_rollback_and_refuses_a_misspelling(
    api, admin_token, environment
):
    assert GatePolicy().auto_rollback_on_failed_verification is False  # default off
    body = {**NOTHING_GATED, "auto_rollback_on_failed_verification": True}

    response = put(api, environment, body, admin_token)

    assert response.status_code == 200, response.content
    assert response.json()["policy"]["auto_rollback_on_failed_verification"] is True
    assert gate_policy_for(environment).auto_rollback_on_failed_verification is True
    misspelt = {**NOTHING_GATED, "auto_rollback": True}
    error = error_of(
        put(api, environment, misspelt, admin_token), 422, "validation_error"
    )
    assert field_names(error) == {"auto_rollback"}
    not_a_bool = {**NOTHING_GATED, "auto_rollback_on_failed_verification": "yes"}
    error = error_of(
        put(api, environment, not_a_bool, admin_token), 422, "validation_error"
    )
    assert field_names(error) == {"auto_rollback_on_failed_verification"}
