"""The MoE routing gate: router agreement and expert-load shift at the worst MoE
layer against the policy; a dense release not subject to it, a MoE release
without routing evidence inconclusive, never a pass."""

import pytest
from pydantic import ValidationError

from controlplane.releases.gates import (
    GatePolicy,
    QualityPolicy,
    RoutingThresholds,
    evaluate_gates,
    evaluate_policy,
)
from gpuagent.protocol import Interval, LayerRouting, RoutingReport
from tests.controlplane.releases.test_evaluate_policy import quality_report


def layer(index, agreement=0.9, shift=0.01, change=0.2, ci95=None):
    return LayerRouting(
        layer=index,
        num_tokens=2048,
        router_agreement=agreement,
        router_agreement_ci95=ci95,
        mean_jaccard=min(1.0, agreement + 0.05),
        load_shift=shift,
        max_load_change=change,
        max_load_change_expert=3,
    )


def moe(*layers) -> RoutingReport:
    return RoutingReport.measured(list(layers) or [layer(1), layer(2)], 256, 8)


def routing_outcomes(routing, policy=None):
    outcomes = evaluate_policy(
        policy or GatePolicy(load=None),
        quality_report(routing=routing),
        None,
        True,
    )
    return {o.metric: o for o in outcomes if o.gate == "routing"}, outcomes


def test_a_moe_release_that_routes_as_its_parent_passes():
    routing, outcomes = routing_outcomes(moe())

    assert sorted(routing) == ["expert_load_shift", "router_agreement"]
    assert routing["router_agreement"].outcome == "pass"
    assert routing["router_agreement"].observed == 0.9
    assert routing["router_agreement"].threshold == 0.6
    assert routing["expert_load_shift"].outcome == "pass"
    assert evaluate_gates(outcomes).outcome == "pass"


def test_the_worst_layer_fails_the_release_and_is_named():
    routing, outcomes = routing_outcomes(
        moe(layer(1), layer(2, agreement=0.41), layer(3, shift=0.08))
    )

    agreement, shift = routing["router_agreement"], routing["expert_load_shift"]
    assert (agreement.outcome, agreement.observed) == ("fail", 0.41)
    assert "layer 2" in agreement.reason and "3 MoE layers" in agreement.reason
    assert (shift.outcome, shift.observed) == ("fail", 0.08)
    assert "layer 3" in shift.reason
    decision = evaluate_gates(outcomes)
    assert (
        decision.outcome == "fail" and "routing (router_agreement)" in decision.reason
    )


def test_an_interval_across_the_threshold_is_too_few_tokens_to_tell():
    unsure = layer(2, agreement=0.58, ci95=Interval(low=0.52, high=0.64))
    sure = layer(2, agreement=0.58, ci95=Interval(low=0.55, high=0.59))

    found, outcomes = routing_outcomes(moe(layer(1), unsure))
    assert found["router_agreement"].outcome == "inconclusive"
    assert "too few tokens to tell" in found["router_agreement"].reason
    assert evaluate_gates(outcomes).outcome == "inconclusive"
    found, _ = routing_outcomes(moe(layer(1), sure))
    assert found["router_agreement"].outcome == "fail"


@pytest.mark.parametrize(
    "routing",
    [
        None,
        RoutingReport(status="unknown", reason="routing is not visible over HTTP"),
    ],
    ids=["report-without-routing", "http-endpoint"],
)
def test_no_routing_evidence_is_inconclusive_never_a_pass(routing):
    found, outcomes = routing_outcomes(routing)

    assert {o.outcome for o in found.values()} == {"inconclusive"}
    assert all(o.reason.startswith("no evidence: ") for o in found.values())
    if routing is not None:
        assert "not visible over HTTP" in found["router_agreement"].reason
    assert evaluate_gates(outcomes).outcome == "inconclusive"


def test_a_dense_release_is_not_subject_to_it():
    dense = RoutingReport(status="not_applicable", reason="dense model")

    found, outcomes = routing_outcomes(dense)

    assert [(o.outcome, o.reason) for o in found.values()] == [
        ("skipped", "not applicable: dense model")
    ]
    assert evaluate_gates(outcomes).outcome == "pass"


def test_a_check_switched_off_is_not_held_and_routing_null_stops_it():
    off = GatePolicy(
        load=None,
        quality=QualityPolicy(
            routing=RoutingThresholds(
                min_router_agreement=None, max_expert_load_change=0.5
            )
        ),
    )
    found, _ = routing_outcomes(moe(layer(1, agreement=0.1, change=0.7)), off)

    assert sorted(found) == ["expert_load_change", "expert_load_shift"]
    assert found["expert_load_change"].outcome == "fail"
    assert found["expert_load_change"].observed == 0.7

    unrouted = GatePolicy(load=None, quality=QualityPolicy(routing=None))
    found, outcomes = routing_outcomes(None, unrouted)
    assert found == {} and evaluate_gates(outcomes).outcome == "pass"


def test_a_zero_shift_limit_is_a_limit_not_off():
    strict = GatePolicy(
        load=None,
        quality=QualityPolicy(routing=RoutingThresholds(max_expert_load_shift=0.0)),
    )

    found, _ = routing_outcomes(moe(layer(1, shift=0.001)), strict)

    assert found["expert_load_shift"].outcome == "fail"


def test_the_thresholds_refuse_unknown_keys_and_bad_values():
    for bad in (
        {"min_router_agreement": 1.5},
        {"max_expert_load_shift": -0.1},
        {"min_router_agreement": "0.9"},
        {"min_agreement": 0.9},
    ):
        with pytest.raises(ValidationError):
            QualityPolicy.model_validate({"routing": bad})
