import time

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.releases import tasks
from controlplane.releases.actions import (
    do_finish_job,
    do_record_gate_result,
    do_request_promotion,
    do_start_job,
)
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import run_promotion

STAGES = ["verify_source", "compress", "sign", "evaluate", "gate"]


def test_it_runs_every_stage_and_pauses_at_the_gate_without_evidence(release):
    """Nothing records gate evidence in this pipeline yet: no evidence is no pass."""
    assert run_promotion(release.pk) == "gated"

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
    ]


def test_later_evidence_lets_the_gate_pass_on_the_next_promote(release, pass_gates):
    run_promotion(release.pk)
    gate = Job.objects.get(release=release, kind="gate")
    assert gate.result["outcome"] == "inconclusive"
    pass_gates(release)

    assert run_promotion(release.pk) == "awaiting_approval"

    assert Job.objects.filter(release=release, kind="gate").count() == 2


def test_it_is_idempotent(release):
    run_promotion(release.pk)

    assert run_promotion(release.pk) == "gated"

    # Only the gate runs again (a paused gate is re-evaluated on each promote).
    kinds = list(Job.objects.filter(release=release).values_list("kind", flat=True))
    assert kinds == [*STAGES, "gate"]


def test_it_resumes_from_the_current_state(make_release):
    release = make_release(state="evaluating")

    assert run_promotion(release.pk) == "gated"

    assert [j.kind for j in Job.objects.filter(release=release)] == ["evaluate", "gate"]


@pytest.fixture
def model_folder(make_source):
    return make_source(
        "model",
        {
            "config.json": '{"model_type": "llama"}',
            "tokenizer_config.json": '{"bos_token": "<s>"}',
        },
    )


def test_it_inspects_and_hashes_a_local_source_folder(make_release, model_folder):
    release = make_release(source_uri=model_folder.as_uri())

    assert run_promotion(release.pk) == "gated"

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

    assert run_promotion(release.pk) == "gated"

    kinds = list(
        Job.objects.filter(release=release)
        .order_by("id")
        .values_list("kind", flat=True)
    )
    assert kinds == STAGES + ["compress", "sign", "evaluate", "gate"]


def test_it_fails_verification_for_a_local_folder_gone_since_registration(
    make_release, model_folder
):
    release = make_release(source_uri=str(model_folder))
    for file in model_folder.iterdir():
        file.unlink()
    model_folder.rmdir()

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


# -- a second run while another worker holds the stage's job -------------------------


@pytest.fixture
def work_calls(monkeypatch) -> list[str]:
    """The kinds whose work ran, in order; each stage's real work still runs."""
    calls: list[str] = []

    def counted(kind, work):
        def run(release):
            calls.append(kind)
            return work(release)

        return run

    for state, (jobs, next_state) in list(tasks.PIPELINE.items()):
        counted_jobs = tuple((kind, counted(kind, work)) for kind, work in jobs)
        monkeypatch.setitem(tasks.PIPELINE, state, (counted_jobs, next_state))
    return calls


@pytest.fixture
def promote(owner, queued):
    """promote(release) -> what the run_promotion the promote queued returns, run
    in-process as a worker would."""

    def run(release) -> str:
        do_request_promotion(release, owner)
        return run_promotion(*queued("run_promotion")[-1])

    return run


@pytest.mark.parametrize(
    ("state", "done", "held"),
    [
        ("verifying", [], "verify_source"),
        ("compressing", [], "compress"),
        ("compressing", ["compress"], "sign"),
        ("evaluating", [], "evaluate"),
        ("gated", [], "gate"),
    ],
)
def test_it_leaves_a_stage_to_the_worker_holding_its_job(
    make_release, work_calls, state, done, held
):
    release = make_release(state=state)
    for kind in done:
        do_finish_job(do_start_job(release, kind), result={})
    job = do_start_job(release, held)  # another worker is at it
    jobs_before = list(Job.objects.filter(release=release).values())
    events_before = AuditEvent.objects.count()

    assert run_promotion(release.pk) == tasks.BUSY

    assert work_calls == []
    stored = Release.objects.get(pk=release.pk)
    assert (stored.state, stored.updated) == (state, release.updated)
    assert list(Job.objects.filter(release=release).values()) == jobs_before
    assert Job.objects.get(pk=job.pk).lease_expires == job.lease_expires
    assert AuditEvent.objects.count() == events_before


def test_it_does_not_run_a_stage_twice_when_promoted_again_during_it(
    release, work_calls, monkeypatch
):
    second_runs = []
    jobs, next_state = tasks.PIPELINE["compressing"]
    (_, compress), sign = jobs

    def compress_while_ci_retries(release):
        # A retried promote's task reaches another worker while compress runs.
        second_runs.append(run_promotion(release.pk))
        return compress(release)

    monkeypatch.setitem(
        tasks.PIPELINE,
        "compressing",
        ((("compress", compress_while_ci_retries), sign), next_state),
    )

    assert run_promotion(release.pk) == "gated"

    assert second_runs == [tasks.BUSY]
    assert work_calls == ["verify_source", "compress", "sign", "evaluate"]
    jobs = Job.objects.filter(release=release).order_by("id")
    assert [j.kind for j in jobs] == STAGES
    assert all((j.state, j.attempts) == ("succeeded", 1) for j in jobs)


def test_it_resumes_a_stage_whose_worker_died_once_its_lease_expires(
    make_release, work_calls, promote, expire_lease
):
    release = make_release(state="compressing")
    job = do_start_job(release, "compress")  # and then its worker died
    assert promote(release) == tasks.BUSY  # too early: the lease still holds
    expire_lease(job)  # its worker died

    assert promote(release) == "gated"
    assert work_calls == ["compress", "sign", "evaluate"]
    resumed = Job.objects.get(pk=job.pk)
    assert (resumed.state, resumed.attempts) == ("succeeded", 2)
    assert resumed.lease_expires is None
    assert Job.objects.filter(release=release, kind="compress").count() == 1


def test_it_closes_its_job_when_another_run_moved_the_release_meanwhile(
    release, monkeypatch
):
    jobs, next_state = tasks.PIPELINE["verifying"]
    ((_, verify),) = jobs

    def verify_while_another_run_fails_it(release):
        result = verify(release)
        # Meanwhile another run moved the release on (here: failed it).
        other = Release.objects.get(pk=release.pk)
        tasks.actions.do_transition_release(
            other, "failed_verification", actor=tasks.WORKER, reason="other run"
        )
        return result

    monkeypatch.setitem(
        tasks.PIPELINE,
        "verifying",
        ((("verify_source", verify_while_another_run_fails_it),), next_state),
    )

    assert run_promotion(release.pk) == "failed_verification"

    job = Job.objects.get(release=release, kind="verify_source")
    assert job.state == "failed"
    assert "superseded" in job.error
    assert job.lease_expires is None  # nothing holds the stage for a later pass


@pytest.mark.django_db(transaction=True)
def test_a_stage_longer_than_its_lease_keeps_its_job_by_heartbeat(
    release, settings, monkeypatch
):
    # The heartbeat thread writes through its own connection: committed rows only.
    settings.RELEASEGATE_JOB_LEASE_S = 1
    seen = []
    jobs, next_state = tasks.PIPELINE["evaluating"]
    ((_, evaluate),) = jobs

    def slow_evaluate(release):
        if seen:  # a second run got the job: the lease was lost (no recursion)
            seen.append("evaluate ran twice")
            return evaluate(release)
        started = Job.objects.get(release=release, kind="evaluate")
        time.sleep(2.5)  # 2.5 leases; beats come every third of one
        job = Job.objects.get(pk=started.pk)
        seen.append((started.lease_expires, job.lease_expires, timezone.now()))
        # Another worker's promote (a CI retry) must still find the job taken.
        seen.append(run_promotion(release.pk))
        return evaluate(release)

    monkeypatch.setitem(
        tasks.PIPELINE, "evaluating", ((("evaluate", slow_evaluate),), next_state)
    )

    state = run_promotion(release.pk)

    assert "evaluate ran twice" not in seen
    (first_lease, lease_then, then), second_run = seen
    assert state == "gated"
    assert first_lease < then < lease_then  # expired once, renewed since
    assert second_run == tasks.BUSY
    job = Job.objects.get(release=release, kind="evaluate")
    assert (job.state, job.attempts, job.lease_expires) == ("succeeded", 1, None)


def test_its_job_results_name_files_relative_to_the_source(make_release, model_folder):
    (model_folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    release = make_release(source_uri=model_folder.as_uri())

    run_promotion(release.pk)

    verify = Job.objects.get(release=release, kind="verify_source")
    stored = Release.objects.get(pk=release.pk)
    for text in (str(verify.result), verify.error, stored.failure_reason):
        assert str(model_folder) not in text
        assert str(model_folder.parent) not in text
    assert verify.result["report"]["folder"] == "."
