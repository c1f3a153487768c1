"""What a gate check says: one GateOutcome per check, pass / fail / inconclusive /
skipped with what was observed, the threshold and why, and the release's decision
over them (`evaluate_gates`). Pure functions, no Django."""

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from gpuagent.protocol import Interval

# "skipped": a check that does not apply, with why (a comparison with live where
# nothing is live); it neither passes a release nor holds it.
PASS, FAIL, INCONCLUSIVE, SKIPPED = "pass", "fail", "inconclusive", "skipped"


@dataclass(frozen=True)
class GateOutcome:
    gate: str  # "integrity", "quality:<slice>", "load:<workload>", "capacity", "live"
    metric: str
    observed: float | None
    threshold: float | None
    outcome: str  # PASS | FAIL | INCONCLUSIVE | SKIPPED
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GateDecision:
    ok: bool
    outcome: str  # PASS | FAIL | INCONCLUSIVE
    reason: str


def evaluate_gates(results: Iterable) -> GateDecision:
    """Any fail fails; otherwise any inconclusive pauses; otherwise pass (a
    skipped check, one that does not apply, counts neither way). No results, or
    only skipped ones, is inconclusive: nothing was shown, so nothing passed."""
    results = list(results)
    failed = [r for r in results if r.outcome == FAIL]
    if failed:
        names = ", ".join(f"{r.gate} ({r.metric})" for r in failed)
        return GateDecision(False, FAIL, f"failed gates: {names}")
    inconclusive = [r for r in results if r.outcome == INCONCLUSIVE]
    if inconclusive:
        names = ", ".join(f"{r.gate} ({r.metric})" for r in inconclusive)
        return GateDecision(False, INCONCLUSIVE, f"inconclusive gates: {names}")
    passed = [r for r in results if r.outcome == PASS]
    if not passed:
        why = "every check was skipped" if results else "no gate results recorded"
        return GateDecision(False, INCONCLUSIVE, f"{why}: no evidence is no pass")
    skipped = [r for r in results if r.outcome == SKIPPED]
    why = f", {len(skipped)} skipped" if skipped else ""
    return GateDecision(True, PASS, f"{len(passed)} gate(s) passed{why}")


def compare(
    gate: str,
    metric: str,
    observed: float | None,
    threshold: float,
    bound: str,  # "max": observed <= threshold passes; "min": >=
    missing: str = "",
    ci95: Interval | None = None,
) -> GateOutcome:
    """`observed` against `threshold`; `missing` (why there is no evidence) or
    no `observed` is inconclusive, and so is a 95% interval holding the
    threshold."""
    if missing or observed is None:
        reason = missing or "no evidence: not measured"
        return GateOutcome(gate, metric, observed, threshold, INCONCLUSIVE, reason)
    if ci95 is not None and ci95.low <= threshold <= ci95.high:
        return GateOutcome(
            gate,
            metric,
            observed,
            threshold,
            INCONCLUSIVE,
            f"the 95% interval [{ci95.low:.4g}, {ci95.high:.4g}] holds the threshold "
            f"{threshold:.4g}: too few tokens to tell",
        )
    ok = observed <= threshold if bound == "max" else observed >= threshold
    sign = "<=" if bound == "max" else ">="
    verdict = "" if ok else "not "
    return GateOutcome(
        gate,
        metric,
        observed,
        threshold,
        PASS if ok else FAIL,
        f"{metric} {observed:.4g} is {verdict}{sign} {threshold:.4g}",
    )
