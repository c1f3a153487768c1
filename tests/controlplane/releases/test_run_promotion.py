import pytest

from controlplane.audit.models import AuditEvent
from controlplane.releases.actions import do_record_gate_result
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import run_promotion

STAGES = ["verify_source", "compress", "sign", "evaluate", "gate"]


def test_it_runs_every_stage_and_stops_for_approval(release):
    assert run_promotion(release.pk) == "awaiting_approval"

    jobs = list(Job.objects.filter(release=release).order_by("id"))
    assert [j.kind for j in jobs] == STAGES
    assert all(j.state == "succeeded" for j in jobs)
    assert all(j.started and j.finished and j.finished >= j.started for j in jobs)
    states = [
        e.after["state"]
        for e in AuditEvent.objects.filter(verb="release.transition").order_by("id")
    ]
    assert states == [
        "verifying",
        "compressing",
        "evaluating",
        "gated",
        "awaiting_approval",
    ]


def test_it_is_idempotent(release):
    run_promotion(release.pk)

    assert run_promotion(release.pk) == "awaiting_approval"

    assert Job.objects.filter(release=release).count() == len(STAGES)


def test_it_resumes_from_the_current_state(make_release):
    release = make_release(state="evaluating")

    assert run_promotion(release.pk) == "awaiting_approval"

    assert [j.kind for j in Job.objects.filter(release=release)] == ["evaluate", "gate"]


@pytest.fixture
def model_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    return folder


def test_it_inspects_and_hashes_a_local_source_folder(make_release, model_folder):
    release = make_release(source_uri=model_folder.as_uri())

    assert run_promotion(release.pk) == "awaiting_approval"

    verify = Job.objects.get(release=release, kind="verify_source")
    assert verify.result["report"]["ok"] is True
    stored = Release.objects.get(pk=release.pk)
    assert stored.manifest_digest.startswith("sha256")
    assert Job.objects.get(release=release, kind="sign").result["manifest_digest"] == (
        stored.manifest_digest
    )
    artifacts = {a.path: a for a in stored.artifacts.all()}
    assert sorted(artifacts) == ["config.json", "tokenizer_config.json"]
    assert artifacts["config.json"].size_bytes == len('{"model_type": "llama"}')


def test_it_binds_the_manifest_to_the_bytes(make_release, model_folder):
    first = make_release(source_uri=model_folder.as_uri())
    run_promotion(first.pk)
    (model_folder / "config.json").write_text('{"model_type": "mistral"}')
    second = make_release(source_uri=model_folder.as_uri())

    run_promotion(second.pk)

    digests = Release.objects.filter(pk__in=[first.pk, second.pk]).values_list(
        "manifest_digest", flat=True
    )
    assert len(set(digests)) == 2


def test_it_fails_verification_on_a_pickle_and_names_the_file(
    make_release, model_folder
):
    (model_folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    release = make_release(source_uri=model_folder.as_uri())

    assert run_promotion(release.pk) == "failed_verification"

    stored = Release.objects.get(pk=release.pk)
    assert "pytorch_model.bin" in stored.failure_reason
    assert stored.manifest_digest == ""
    assert not Job.objects.filter(release=release, kind="compress").exists()


def test_it_skips_a_job_already_done_in_this_pass(make_release):
    release = make_release()
    run_promotion(release.pk)
    # Simulate a worker that died after compress but before sign: back in
    # compressing with compress succeeded in this pass.
    Release.objects.filter(pk=release.pk).update(state="registered")
    from controlplane.releases.actions import (
        do_finish_job,
        do_start_job,
        do_transition_release,
    )

    do_transition_release(release, "verifying", actor="test")
    do_transition_release(release, "compressing", actor="test")
    do_finish_job(do_start_job(release, "compress"), result={})

    assert run_promotion(release.pk) == "awaiting_approval"

    kinds = list(
        Job.objects.filter(release=release)
        .order_by("id")
        .values_list("kind", flat=True)
    )
    assert kinds == STAGES + ["compress", "sign", "evaluate", "gate"]


def test_it_fails_verification_for_a_missing_local_folder(make_release, tmp_path):
    release = make_release(source_uri=str(tmp_path / "nope"))

    assert run_promotion(release.pk) == "failed_verification"

    stored = Release.objects.get(pk=release.pk)
    assert "does not exist" in stored.failure_reason
    job = Job.objects.get(release=release, kind="verify_source")
    assert job.state == "failed"
    assert not Job.objects.filter(release=release, kind="compress").exists()


@pytest.mark.parametrize(
    ("outcome", "state"), [("fail", "failed"), ("inconclusive", "gated")]
)
def test_it_holds_the_release_to_its_gates(make_release, outcome, state):
    release = make_release(state="gated")
    do_record_gate_result(
        release,
        gate="quality",
        metric="perplexity_ratio",
        observed=1.2,
        threshold=1.03,
        outcome=outcome,
    )

    assert run_promotion(release.pk) == state

    assert Job.objects.get(release=release, kind="gate").result["outcome"] == outcome


def test_it_ignores_a_missing_release(db):
    assert run_promotion(987654) == "missing"


def test_it_does_not_touch_a_release_past_the_pipeline(make_release):
    release = make_release(state="approved")

    assert run_promotion(release.pk) == "approved"

    assert not Job.objects.filter(release=release).exists()
