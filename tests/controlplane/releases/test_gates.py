from controlplane.releases.gates import evaluate_gates
from controlplane.releases.models import GateResult


def result(outcome, gate="quality"):
    return GateResult(gate=gate, metric="m", observed=1, threshold=1, outcome=outcome)


def test_it_passes_when_every_gate_passes():
    decision = evaluate_gates([result("pass"), result("pass", "load")])

    assert decision.ok and decision.outcome == "pass"


def test_it_fails_when_any_gate_fails_even_with_inconclusive_ones():
    decision = evaluate_gates([result("inconclusive"), result("fail", "load")])

    assert not decision.ok
    assert decision.outcome == "fail"
    assert "load" in decision.reason


def test_it_pauses_on_inconclusive():
    decision = evaluate_gates([result("pass"), result("inconclusive", "load")])

    assert (decision.ok, decision.outcome) == (False, "inconclusive")


def test_no_results_is_no_pass():
    decision = evaluate_gates([])

    assert (decision.ok, decision.outcome) == (False, "inconclusive")
    assert "no gate results" in decision.reason
