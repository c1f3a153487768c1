"""Gate evaluation: pure functions over recorded GateResults."""

from dataclasses import dataclass


@dataclass(frozen=True)
class GateDecision:
    ok: bool
    outcome: str  # "pass" | "fail" | "inconclusive"
    reason: str


def evaluate_gates(results) -> GateDecision:
    """Any fail fails; otherwise any inconclusive pauses; otherwise pass. With no
    results the gate passes and says so: no evaluation work exists yet, and a person
    still has to approve."""
    results = list(results)
    failed = [r for r in results if r.outcome == "fail"]
    if failed:
        names = ", ".join(f"{r.gate} ({r.metric})" for r in failed)
        return GateDecision(False, "fail", f"failed gates: {names}")
    inconclusive = [r for r in results if r.outcome == "inconclusive"]
    if inconclusive:
        names = ", ".join(f"{r.gate} ({r.metric})" for r in inconclusive)
        return GateDecision(False, "inconclusive", f"inconclusive gates: {names}")
    if not results:
        return GateDecision(True, "pass", "no gate results recorded")
    return GateDecision(True, "pass", f"{len(results)} gate(s) passed")
