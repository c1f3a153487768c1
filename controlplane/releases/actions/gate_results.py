"""Gate results: recorded one by one, or evaluated against the policy."""

from django.db import transaction

from controlplane.audit.actions import Actor, do_record_event
from controlplane.costs.actions import cost_model_for
from controlplane.errors import ValidationFailed
from controlplane.fleet.models import Environment
from controlplane.releases import evidence
from controlplane.releases.actions.gate_policies import gate_policy_in_force
from controlplane.releases.gate_outcomes import FAIL
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
    _, version = gate_policy_in_force(release.target_environment)
    with transaction.atomic():
        result = GateResult.objects.create(
            release=release,
            policy_version=version,
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
    why: str = "",
) -> GateDecision:
    """Hold the evidence against the gate policy of the release's target
    environment (gates.evaluate_policy) and record one GateResult per outcome,
    replacing the release's earlier results (the audit event keeps what they said).
    Returns the decision over them; moving the release is the caller's (the
    pipeline's gate stage). Missing evidence (None) is inconclusive, never a pass.
    Capacity and cost are compared with the release live in the environment
    (evidence.live_baseline) and priced with the environment's cost model. Each
    result records the policy's version; `why` (e.g. a re-evaluation's cause) goes
    into the audit event."""
    environment = release.target_environment
    policy, version = gate_policy_in_force(environment)
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
            GateResult(release=release, policy_version=version, **outcome.to_dict())
            for outcome in outcomes
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
                "policy_version": version,
                **({"why": why} if why else {}),
            },
            team=release.team,
        )
    return decision


def do_recheck_release_gates(release: Release, *, actor: Actor) -> GateDecision | None:
    """The release's gate decision under the policy in force now, for an approval:
    the recorded results' decision when they were all held against the current
    policy version; else the recorded evidence evaluated again (and recorded, as
    do_evaluate_release_gates does), naming both versions. None when the release
    has no gate results to hold (nothing ran the gate)."""
    recorded = list(release.gate_results.all())
    if not recorded:
        return None
    # Policy writes hold the environment's row lock: none commits before the
    # caller's decision does.
    Environment.objects.select_for_update().get(pk=release.target_environment_id)
    _, version = gate_policy_in_force(release.target_environment)
    versions = sorted({r.policy_version for r in recorded})
    if versions == [version]:
        return evaluate_gates(recorded)
    # A change of the cost model that prices the policy's cost checks bumps
    # the version too (costs.actions).
    changed = (
        f"the gate policy of {release.target_environment} (or the cost model its "
        f"cost checks price with) changed since the gate ran (version "
        f"{', '.join(map(str, versions))} -> {version})"
    )
    try:
        quality = evidence.quality_report(release)
        load = evidence.load_report(release)
    except evidence.EvidenceUnreadable as exc:
        return GateDecision(False, FAIL, f"{changed}; {exc.message}")
    decision = do_evaluate_release_gates(
        release,
        quality=quality,
        load=load,
        integrity_ok=evidence.integrity_ok(release),
        actor=actor,
        why=changed,
    )
    return GateDecision(decision.ok, decision.outcome, f"{changed}: {decision.reason}")
