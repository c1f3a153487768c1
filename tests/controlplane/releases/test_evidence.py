import pytest

from controlplane.releases import evidence
from controlplane.releases.actions.jobs import do_finish_job, do_start_job
from controlplane.releases.actions.manifests import do_record_manifest
from controlplane.releases.actions.transitions import do_transition_release
from gpuagent.protocol import FileDigest
from tests.controlplane.dashboard.builders import load_test_report, quality_report

SIGNER = "ci-signing@acme.example"


def _job(release, kind, result=None, error=""):
    return do_finish_job(do_start_job(release, kind), result=result, error=error)


def test_it_reads_the_newest_succeeded_quality_report(release):
    older = quality_report(release, kld=0.001)
    newer = quality_report(release, kld=0.002)
    _job(release, "evaluate", older.model_dump(mode="json"))
    _job(release, "evaluate", newer.model_dump(mode="json"))
    _job(release, "evaluate", error="agent lost")

    assert evidence.quality_report(release) == newer


def test_it_reads_the_load_report(release):
    report = load_test_report(release.recipe)
    _job(release, "load_test", report.model_dump(mode="json"))

    assert evidence.load_report(release) == report


def test_it_has_no_report_without_a_succeeded_job(release):
    _job(release, "evaluate", error="timed out")
    do_start_job(release, "load_test")  # still running

    assert evidence.quality_report(release) is None
    assert evidence.load_report(release) is None


def test_it_names_the_job_and_field_of_an_unreadable_report(release):
    bad = quality_report(release).model_dump(mode="json")
    bad["slices"][0]["same_top1"] = 1.5
    job = _job(release, "evaluate", bad)

    with pytest.raises(evidence.EvidenceUnreadable) as caught:
        evidence.quality_report(release)

    assert f"evaluate job {job.pk}" in caught.value.message
    assert "slices.0.same_top1" in caught.value.message


def test_it_takes_a_skipped_stage_for_no_report(release):
    # The pipeline today records {"skipped": ...} for an evaluate with no agent work:
    # the newest run measured nothing, so there is no report, not an older one.
    _job(release, "evaluate", quality_report(release).model_dump(mode="json"))
    _job(release, "evaluate", {"skipped": "no agent work for this stage yet"})

    assert evidence.quality_report(release) is None


def test_it_reads_the_newest_load_report_of_many_releases(make_release):
    first, second, bare = make_release(), make_release(), make_release()
    old = load_test_report(first.recipe, speed=1.0)
    new = load_test_report(first.recipe, speed=2.0)
    _job(first, "load_test", old.model_dump(mode="json"))
    _job(first, "load_test", new.model_dump(mode="json"))
    _job(second, "load_test", old.model_dump(mode="json"))

    reports = evidence.load_reports([first, second, bare])

    assert reports == {first.pk: new, second.pk: old}


def test_it_says_never_verified_when_no_job_hashed_the_bytes(release):
    _job(release, "deploy", {"skipped": "no agent work for this stage yet"})

    verification = evidence.verification(release)

    assert verification.ok is None
    assert verification.detail == "never verified after signing"


def test_it_takes_the_newest_verifying_job(release):
    _job(release, "verify", {"ok": True})
    job = _job(release, "reverify", {"changed": ["model.safetensors"]}, "mismatch")

    verification = evidence.verification(release)

    assert (verification.ok, verification.kind) == (False, "reverify")
    assert verification.checked == job.finished
    assert verification.changed == ["model.safetensors"]
    assert verification.detail == "mismatch"


def test_it_never_calls_a_quarantined_release_verified(release):
    _job(release, "verify", {"ok": True})
    do_transition_release(release, "verifying", actor="system:worker")
    do_transition_release(
        release, "failed_verification", actor="system:worker", reason="tampered"
    )

    verification = evidence.verification(release)

    assert verification.ok is False
    assert verification.detail == "tampered"


def test_it_reports_signature_and_signer(release):
    do_record_manifest(
        release,
        manifest_digest="sha256:" + "a" * 64,
        files=[FileDigest(path="m.safetensors", size_bytes=1, digest="sha256:1")],
        signature="bundle",
    )
    _job(release, "sign", {"signer": SIGNER})
    _job(release, "verify", {"ok": True})

    integrity = evidence.integrity(release)

    assert (integrity.signed, integrity.signer) == (True, SIGNER)
    assert integrity.verification.ok is True


def test_it_reports_an_unsigned_release(release):
    integrity = evidence.integrity(release)

    assert (integrity.signed, integrity.signer) == (False, "")
    assert integrity.verification.ok is None
