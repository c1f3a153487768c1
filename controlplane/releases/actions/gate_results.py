"""Gate results: recorded one by one, or evaluated against the policy."""

from django.db import transaction

from controlplane.audit.actions import Actor, do_record_event
from controlplane.costs.actions import cost_model_for
from controlplane.errors import ValidationFailed
from controlplane.releases import evidence
from controlplane.releases.actions.gate_policies import gate_policy_for
from controlplane.releases.gates import (
    GateDecision,
    evaluate_gates,
    evaluate_policy,
)
from controlplane.releases.models import (
    GATE_OUTCOMES,
    GateResult,
    Release,
)
from gpuagent.protocol import (
    LoadTestReport,
    QualityReport,
)


def do_record_gate_result(
    release: Release,
    *,
    gate: str,
    metric: str,
    observed: float | None,
    threshold: float | None,
    outcome: str,
    reason: str = "",
) -> GateResult:
    if outcome not in GATE_OUTCOMES:
        raise ValidationFailed(
            f"outcome must be one of {', '.join(GATE_OUTCOMES)}", field="outcome"
        )
    with transaction.atomic():
        result = GateResult.objects.create(
            release=release,
            gate=gate,
            metric=metric,
            observed=observed,
            threshold=threshold,
            outcome=outcome,
            reason=reason,
        )
        do_record_event(
            "system:worker",
            "gate.recorded",
            release,
            after=result.to_dict(),
            team=release.team,
        )
    return result


def do_evaluate_release_gates(
    release: Release,
    *,
    quality: QualityReport | None,
    load: LoadTestReport | None,
    integrity_ok: bool | None,
    actor: Actor = "system:worker",
) -> GateDecision:
    """Hold the evidence against the gate policy of the release's target
    environment (gates.evaluate_policy) and record one GateResult per outcome,
    replacing the release's earlier results (the audit event keeps what they said).
    Returns the decision over them; moving the release is the caller's (the
    pipeline's gate stage). Missing evidence (None) is inconclusive, never a pass.
    Capacity and cost are compared with the release live in the environment
    (evidence.live_baseline) and priced with the environment's cost model."""
    environment = release.target_environment
    policy = gate_policy_for(environment)
    outcomes = evaluate_policy(
        policy,
        quality,
        load,
        integrity_ok,
        live=evidence.live_baseline(release),
        pricing=cost_model_for(environment).pricing,
    )
    decision = evaluate_gates(outcomes)
    with transaction.atomic():
        release.gate_results.all().delete()
        GateResult.objects.bulk_create(
            GateResult(release=release, **outcome.to_dict()) for outcome in outcomes
        )
        counts = {o: sum(r.outcome == o for r in outcomes) for o in GATE_OUTCOMES}
        do_record_event(
            actor,
            "gate.evaluated",
            release,
            after={
                "outcome": decision.outcome,
                "reason": decision.reason,
                "counts": counts,
                "policy": policy.model_dump(mode="json"),
            },
            team=release.team,
        )
    return decision
