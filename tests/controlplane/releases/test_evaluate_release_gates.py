import pytest

from controlplane.audit.models import AuditEvent
from controlplane.costs.actions import cost_model_for
from controlplane.costs.report import economics
from controlplane.fleet.actions import do_register_agent
from controlplane.releases.actions.gate_policies import (
    do_set_gate_policy,
    gate_policy_for,
)
from controlplane.releases.actions.gate_results import do_evaluate_release_gates
from controlplane.releases.gates import evaluate_gates
from tests.controlplane.dashboard.builders import (
    load_test_report,
    set_price,
    take_live,
    to_awaiting_approval,
)
from tests.controlplane.releases.test_evaluate_policy import load_report, quality_report


def test_it_records_one_result_per_check_under_the_environments_policy(
    release, environment, owner
):
    do_set_gate_policy(
        environment, {"load": None, "quality": {"slices": ["english"]}}, actor=owner
    )

    decision = do_evaluate_release_gates(
        release, quality=quality_report(), load=load_report(), integrity_ok=True
    )

    assert (decision.ok, decision.outcome) == (True, "pass")
    results = list(release.gate_results.all())
    assert ("integrity", "verified") in {(r.gate, r.metric) for r in results}
    assert not any(r.gate.startswith("load") for r in results)  # not gated
    kld = release.gate_results.get(gate="quality:english", metric="mean_kld")
    assert (kld.observed, kld.threshold, kld.outcome) == (0.01, 0.03, "pass")
    assert evaluate_gates(results) == decision
    event = AuditEvent.objects.get(verb="gate.evaluated")
    assert event.after["outcome"] == "pass"
    assert event.after["policy"]["load"] is None


def test_no_evidence_records_inconclusive_results(release):
    decision = do_evaluate_release_gates(
        release, quality=None, load=None, integrity_ok=None
    )

    assert decision.outcome == "inconclusive"
    assert set(release.gate_results.values_list("outcome", flat=True)) == {
        "inconclusive"
    }


def test_new_evidence_replaces_the_earlier_results(release):
    do_evaluate_release_gates(release, quality=None, load=None, integrity_ok=False)

    decision = do_evaluate_release_gates(
        release, quality=quality_report(), load=load_report(), integrity_ok=True
    )

    assert decision.outcome == "pass"
    assert not release.gate_results.filter(outcome__in=["fail", "inconclusive"])
    assert AuditEvent.objects.filter(verb="gate.evaluated").count() == 2


def test_it_compares_with_live_and_prices_with_the_cost_model(
    make_release, environment, owner, teammate
):
    """staging: 2 USD a device-hour; chat's cost may rise 10% over live's. The
    candidate (half as fast) costs twice live's per 1M output tokens: it fails."""
    agent = do_register_agent("gpu-a1", queue="agent.gpu-a1")
    set_price(environment, owner, "2.00")
    do_set_gate_policy(
        environment,
        {
            "quality": None,
            "load": {
                "workloads": ["chat"],
                "per_workload": {"chat": {"max_cost_increase_pct": 10}},
            },
        },
        actor=owner,
    )
    live = to_awaiting_approval(make_release("0.9.0"), agent=agent, speed=1.0)
    take_live(live, teammate, agent=agent)
    candidate = make_release("1.0.0")
    slow = load_test_report(candidate.recipe, speed=0.5)

    decision = do_evaluate_release_gates(
        candidate, quality=None, load=slow, integrity_ok=True
    )

    results = {(r.gate, r.metric): r for r in candidate.gate_results.all()}
    live_rows = economics(
        load_test_report(live.recipe, speed=1.0),
        gate_policy_for(environment),
        cost_model_for(environment).pricing,
    )
    mine = economics(
        slow, gate_policy_for(environment), cost_model_for(environment).pricing
    )
    cost = results[("load:chat", "cost_per_1m_output_tokens_vs_live")]
    assert cost.observed == float(mine["chat"].costs.cost_per_1m_output_tokens)
    assert cost.threshold == pytest.approx(
        float(live_rows["chat"].costs.cost_per_1m_output_tokens) * 1.1
    )
    assert cost.outcome == "fail"
    knee = results[("load:chat", "max_concurrency_at_slo")]
    assert knee.threshold == pytest.approx(live_rows["chat"].knee * 0.9)
    assert decision.outcome == "fail"
    assert "live" not in {gate for gate, _ in results}  # there is a baseline
    event = AuditEvent.objects.filter(verb="gate.evaluated").first()
    assert event.after["counts"]["skipped"] == 0


def test_the_first_release_of_an_environment_records_why_it_was_not_compared(
    release,
):
    decision = do_evaluate_release_gates(
        release, quality=quality_report(), load=load_report(), integrity_ok=True
    )

    baseline = release.gate_results.get(gate="live")
    assert (baseline.outcome, baseline.metric) == ("skipped", "baseline")
    assert "nothing is live" in baseline.reason
    assert decision.outcome == "pass"
    # skipped: the live comparison and (a dense model) the routing gate
    routing = release.gate_results.get(gate="routing")
    assert routing.outcome == "skipped" and "not applicable" in routing.reason
    assert AuditEvent.objects.get(verb="gate.evaluated").after["counts"]["skipped"] == 2
