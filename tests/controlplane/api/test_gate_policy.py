import pytest

from controlplane.audit.models import AuditEvent
from controlplane.releases.actions.gate_policies import gate_policy_for
from controlplane.releases.gates import GatePolicy, evaluate_policy
from tests.controlplane.api.helpers import error_of, field_names
from tests.controlplane.releases.test_evaluate_policy import load_report, quality_report

NOTHING_GATED = {"quality": None, "load": None}


def url(environment_id) -> str:
    return f"/api/v1/environments/{environment_id}/gate-policy"


@pytest.fixture
def admin_token(make_token, owner):
    return make_token(owner, "read", "admin")


def put(api, environment, body, token, method="put"):
    return getattr(api.client, method)(
        url(environment.pk),
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


def patch(api, environment, body, token):
    return put(api, environment, body, token, method="patch")


def test_it_shows_the_default_until_one_is_set(api, owner_token, environment):
    response = api.get(url(environment.pk), token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["is_default"] is True
    assert data["policy"] == GatePolicy().model_dump(mode="json")
    assert data["policy"]["quality"]["thresholds"]["max_mean_kld"] == 0.03
    load = data["policy"]["load"]["thresholds"]
    assert (load["max_concurrency_drop_pct"], load["max_goodput_drop_pct"]) == (10, 10)
    assert load["max_cost_increase_pct"] is None
    assert load["min_prefix_cache_hit_rate"] is None


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
    assert data["policy"] == policy.model_dump(mode="json")  # the policy in force
    assert policy.quality.thresholds.max_mean_kld == 0.002
    assert policy.load.capacity.min_sessions == 16
    event = AuditEvent.objects.get(verb="environment.gate_policy_set")
    assert event.after["policy"]["load"]["workloads"] == ["chat"]


def test_a_put_keeps_the_defaults_of_the_thresholds_it_leaves_out(
    api, admin_token, environment
):
    default = GatePolicy()
    body = {
        "quality": {"thresholds": {"max_mean_kld": 0.002}},
        "load": {"thresholds": {"max_ttft_p99_ms": 5000}},
    }

    response = put(api, environment, body, admin_token)

    assert response.status_code == 200, response.content
    policy = gate_policy_for(environment)
    assert policy.quality.thresholds.min_same_top1 == (
        default.quality.thresholds.min_same_top1
    )
    assert policy.load.thresholds.max_tpot_p99_ms == (
        default.load.thresholds.max_tpot_p99_ms
    )
    evidence = (quality_report(), load_report(), True)
    checks = {(o.gate, o.metric) for o in evaluate_policy(policy, *evidence)}
    assert checks == {(o.gate, o.metric) for o in evaluate_policy(default, *evidence)}


def test_only_an_explicit_null_turns_a_check_off(api, admin_token, environment):
    body = {
        "quality": {
            "thresholds": {"max_flip_rate": None},
            "per_slice": {"code": {"max_mean_kld": 0.05}},
        },
        "load": None,
    }

    response = put(api, environment, body, admin_token)

    assert response.status_code == 200, response.content
    quality = response.json()["policy"]["quality"]
    assert quality["thresholds"]["max_flip_rate"] is None
    # An override changes what it names; the rest comes from `thresholds`.
    assert quality["per_slice"]["code"] == {
        **quality["thresholds"],
        "max_mean_kld": 0.05,
    }
    checks = evaluate_policy(gate_policy_for(environment), quality_report(), None, True)
    metrics = {o.metric for o in checks}
    assert "flip_rate" not in metrics and "same_top1" in metrics


def test_a_patch_changes_only_the_keys_it_names(api, admin_token, environment):
    put(
        api,
        environment,
        {"quality": {"thresholds": {"max_mean_kld": 0.002}}, "load": None},
        admin_token,
    )
    change = {"quality": {"thresholds": {"min_same_top1": 0.99, "max_flip_rate": None}}}

    response = patch(api, environment, change, admin_token)

    assert response.status_code == 200, response.content
    policy = gate_policy_for(environment)
    assert response.json()["policy"] == policy.model_dump(mode="json")
    thresholds = policy.quality.thresholds
    assert (thresholds.max_mean_kld, thresholds.min_same_top1) == (0.002, 0.99)
    assert thresholds.max_flip_rate is None
    assert thresholds.max_ppl_ratio == GatePolicy().quality.thresholds.max_ppl_ratio
    assert policy.load is None
    event = AuditEvent.objects.filter(verb="environment.gate_policy_set").first()
    assert event.before["policy"]["quality"]["thresholds"]["min_same_top1"] == 0.92
    assert event.after["changed"] == [
        "quality.thresholds.max_flip_rate",
        "quality.thresholds.min_same_top1",
    ]


def test_a_patch_of_one_routing_threshold_keeps_the_others(
    api, admin_token, environment
):
    default = GatePolicy().quality.routing
    assert (default.min_router_agreement, default.max_expert_load_shift) == (0.6, 0.05)
    put(
        api,
        environment,
        {"quality": {"routing": {"max_expert_load_change": 0.5}}, "load": None},
        admin_token,
    )

    response = patch(
        api,
        environment,
        {"quality": {"routing": {"min_router_agreement": 0.9}}},
        admin_token,
    )

    assert response.status_code == 200, response.content
    routing = gate_policy_for(environment).quality.routing
    assert routing.min_router_agreement == 0.9
    assert routing.max_expert_load_shift == default.max_expert_load_shift
    assert routing.max_expert_load_change == 0.5  # what the put set, kept
    assert response.json()["policy"]["quality"]["routing"] == routing.model_dump()
    event = AuditEvent.objects.filter(verb="environment.gate_policy_set").first()
    assert event.after["changed"] == ["quality.routing.min_router_agreement"]


def test_switching_routing_off_is_explicit(api, admin_token, environment):
    moe = quality_report(routing=None)  # no routing evidence: inconclusive

    one_off = patch(
        api,
        environment,
        {"quality": {"routing": {"min_router_agreement": None}}},
        admin_token,
    )
    assert one_off.status_code == 200, one_off.content
    policy = gate_policy_for(environment)
    metrics = {
        o.metric
        for o in evaluate_policy(policy, moe, None, True)
        if o.gate == "routing"
    }
    assert metrics == {"expert_load_shift"}
    assert policy.quality.thresholds == GatePolicy().quality.thresholds

    all_off = patch(api, environment, {"quality": {"routing": None}}, admin_token)
    assert all_off.status_code == 200, all_off.content
    policy = gate_policy_for(environment)
    assert policy.quality.routing is None
    assert not [
        o for o in evaluate_policy(policy, moe, None, True) if o.gate == "routing"
    ]
    assert policy.quality.slices == GatePolicy().quality.slices


def test_a_patch_starts_from_the_default_and_names_a_bad_key(
    api, admin_token, environment
):
    response = patch(api, environment, {"load": {"workloads": ["chat"]}}, admin_token)

    assert response.status_code == 200, response.content
    policy = gate_policy_for(environment)
    assert policy.load.workloads == ["chat"]
    assert policy.quality == GatePolicy().quality
    bad = patch(
        api, environment, {"quality": {"thresholds": {"max_kld": 1}}}, admin_token
    )
    error = error_of(bad, 422, "validation_failed")
    assert field_names(error) == {"quality.thresholds.max_kld"}
    for nothing, field in (({}, ""), ({"qualty": {}}, "qualty")):
        error = error_of(
            patch(api, environment, nothing, admin_token), 422, "validation_error"
        )
        assert field_names(error) == {field}
    assert gate_policy_for(environment) == policy


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"quality": {"require_retrieval": 0}}, "quality.require_retrieval"),
        ({"quality": {"slices": []}}, "quality.slices"),
        ({"quality": {"slices": ["english", "english"]}}, "quality.slices"),
        ({"quality": {"slices": ["klingon"]}}, "quality.slices"),
        ({"quality": {"per_slice": {"klingon": {}}}}, "quality.per_slice"),
        (
            {"quality": {"thresholds": {"max_mean_kld": "0.03"}}},
            "quality.thresholds.max_mean_kld",
        ),
        (
            {"quality": {"routing": {"min_router_agreement": 1.2}}},
            "quality.routing.min_router_agreement",
        ),
        (
            {"quality": {"routing": {"max_load_shift": 0.1}}},
            "quality.routing.max_load_shift",
        ),
        ({"load": {"workloads": [], "capacity": None}}, "load.workloads"),
        (
            {"load": {"thresholds": {"max_concurrency_drop_pct": 150}}},
            "load.thresholds.max_concurrency_drop_pct",
        ),
        (
            {"load": {"thresholds": {"min_prefix_cache_hit_rate": 1.5}}},
            "load.thresholds.min_prefix_cache_hit_rate",
        ),
        (
            {"load": {"thresholds": {"max_cost_increase_pct": "10"}}},
            "load.thresholds.max_cost_increase_pct",
        ),
        ({"load": {"workloads": ["chat", "chat"]}}, "load.workloads"),
        (
            {"load": {"capacity": {"min_sessions": 16.0, "context_tokens": 8192}}},
            "load.capacity.min_sessions",
        ),
    ],
)
def test_it_refuses_what_the_schema_does_not_say(
    api, admin_token, environment, body, field
):
    response = put(api, environment, {**NOTHING_GATED, **body}, admin_token)

    assert field in field_names(error_of(response, 422, "validation_error"))
    assert gate_policy_for(environment) == GatePolicy()
    error = error_of(
        patch(api, environment, body, admin_token), 422, "validation_failed"
    )
    assert field_names(error) == {field}


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


def test_every_change_answers_a_new_version(api, admin_token, environment):
    assert api.get(url(environment.pk), token=admin_token).json()["version"] == 0

    first = patch(api, environment, {"quality": None}, admin_token)
    second = patch(api, environment, {"load": None}, admin_token)

    assert (first.json()["version"], second.json()["version"]) == (1, 2)
