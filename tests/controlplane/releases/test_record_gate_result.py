import pytest

from controlplane.audit.models import AuditEvent
from controlplane.errors import ValidationFailed
from controlplane.releases.actions.gate_results import do_record_gate_result


def test_it_records_a_gate_result(release):
    result = do_record_gate_result(
        release,
        gate="quality",
        metric="perplexity_ratio",
        observed=1.01,
        threshold=1.03,
        outcome="pass",
    )

    assert release.gate_results.get() == result
    assert AuditEvent.objects.get(verb="gate.recorded").after["gate"] == "quality"


def test_it_refuses_unknown_outcomes(release):
    with pytest.raises(ValidationFailed):
        do_record_gate_result(
            release, gate="q", metric="m", observed=1, threshold=1, outcome="maybe"
        )
