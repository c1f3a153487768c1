from controlplane.audit.models import AuditEvent
from controlplane.releases.actions.gate_policies import do_set_gate_policy
from controlplane.releases.actions.gate_results import do_evaluate_release_gates
from controlplane.releases.gates import evaluate_gates
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
