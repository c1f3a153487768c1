"""The pipeline (controlplane.releases.pipeline) through its Celery tasks, with the
agent's jobs run by gpuagent.tasks in the test process (conftest.LocalAgent): real
inspection, compression, signing and verification of a small model folder; the
evaluate and load-test jobs answered with reports shaped as gpuagent.protocol
fixes them (their real runs are in tests/controlplane/test_agent_pipeline.py)."""

import json
import shutil
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

import gpuagent.engine
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Agent, Deployment
from controlplane.fleet.tasks import record_heartbeat
from controlplane.releases.actions.approvals import do_approve_release
from controlplane.releases.actions.gate_policies import do_set_gate_policy
from controlplane.releases.actions.jobs import do_dispatch_job, do_finish_job
from controlplane.releases.actions.promotion import do_reopen_release
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import (
    run_deployment,
    run_promotion,
    run_reverification,
    watch_jobs,
)
from controlplane.releases.timings import stage_timings
from gpuagent.protocol import DeployResult, VerifyResult
from tests.controlplane.releases.test_evaluate_policy import load_report, quality_report
from tests.controlplane.releases.test_transition_release import erase_audit_log

BF16 = {"weights": "bf16", "kv_cache_dtype": "int8"}
DEMO_MODEL = Path(gpuagent.engine.__file__).parent / "demo_model"


@pytest.fixture
def model_folder(make_source):
    """A copy of the demo model (12.9 MB) in the team's source root: the compress
    job loads and casts it for real."""
    folder = make_source("model")
    for path in DEMO_MODEL.iterdir():
        if path.is_file():
            shutil.copyfile(path, folder / path.name)
    return folder


@pytest.fixture
def bf16_release(make_release, model_folder):
    return make_release(source_uri=model_folder.as_uri(), recipe=BF16)


def promote_to_tests(release, local_agent) -> None:
    assert run_promotion(release.pk) == "verifying"
    local_agent.work()
    release.refresh_from_db()
    assert release.state == "evaluating", release.failure_reason


def promote_to_approval(release, local_agent) -> None:
    promote_to_tests(release, local_agent)
    local_agent.answer("evaluate", quality_report())
    local_agent.answer("load_test", load_report())
    release.refresh_from_db()
    assert release.state == "awaiting_approval", release.failure_reason


def test_it_runs_integrity_stages_on_the_agent_then_both_tests_in_parallel(
    bf16_release, local_agent
):
    promote_to_tests(bf16_release, local_agent)

    kinds = [j.kind for j in Job.objects.filter(release=bf16_release).order_by("id")]
    assert kinds == [
        "verify_source",
        "compress",
        "sign",
        "verify",
        "evaluate",
        "load_test",
    ]
    assert {r.kind for _, r in local_agent.pending()} == {"evaluate", "load_test"}
    assert bf16_release.manifest_digest.startswith("sha256:")
    assert bf16_release.signature.startswith("{")  # the signature file itself
    # one artifact a candidate file: what the compress job wrote from the demo model
    assert sorted(bf16_release.artifacts.values_list("path", flat=True)) == sorted(
        p.name for p in DEMO_MODEL.iterdir() if p.is_file()
    )
    done = Job.objects.filter(release=bf16_release, state="succeeded")
    assert all(j.started and j.finished for j in done)
    # verified by another enrolled agent than the one that signed
    assert {j.kind: j.agent.name for j in done} == {
        "verify_source": "local",
        "compress": "local",
        "sign": "local",
        "verify": "checker",
    }


def test_it_audits_what_an_agents_results_set_off_as_that_agent(
    bf16_release, local_agent
):
    promote_to_tests(bf16_release, local_agent)

    events = AuditEvent.objects.filter(object_id=str(bf16_release.pk))
    moves = events.filter(verb="release.transition").order_by("id")
    assert [(e.after["state"], e.actor_name) for e in moves] == [
        ("verifying", "system:worker"),  # run_promotion: no agent involved
        ("compressing", "agent:local"),  # each next state: the agent's result
        ("evaluating", "agent:checker"),  # the verify, by another agent than the signer
    ]
    finished = AuditEvent.objects.filter(verb="job.succeeded")
    assert {e.actor_name for e in finished} == {"agent:local", "agent:checker"}


def test_it_gates_on_the_recorded_evidence_then_waits_for_approval(
    bf16_release, local_agent
):
    promote_to_approval(bf16_release, local_agent)

    gates = {(g.gate, g.outcome) for g in bf16_release.gate_results.all()}
    assert ("integrity", "pass") in gates
    assert ("quality:korean", "pass") in gates
    assert ("load:rag-ko", "pass") in gates
    assert ("live", "skipped") in gates  # its environment's first: no baseline
    assert ("routing", "skipped") in gates  # the demo model is dense
    skippable = ("live", "routing")
    assert {outcome for gate, outcome in gates if gate not in skippable} == {"pass"}
    timings = stage_timings(bf16_release)
    assert timings["time_to_deploy_s"] > 0
    assert 0 <= timings["integrity_pct"] <= 100


def test_it_fails_a_release_whose_evidence_fails_its_gate(bf16_release, local_agent):
    promote_to_tests(bf16_release, local_agent)
    local_agent.answer("evaluate", quality_report())

    local_agent.answer("load_test", load_report(kv_bytes_per_token=1))
    do_set_gate_policy(
        bf16_release.target_environment,
        {"load": {"thresholds": {"max_ttft_p99_ms": 1}}},
        actor=bf16_release.created_by,
    )
    bf16_release.refresh_from_db()
    # the policy changed after the gate: a promote re-runs it
    Release.objects.filter(pk=bf16_release.pk).update(state="gated")

    assert run_promotion(bf16_release.pk) == "failed"

    assert (
        "load:chat (ttft_p99_ms)"
        in Release.objects.get(pk=bf16_release.pk).failure_reason
    )


def finish(release, kind: str) -> None:
    """The newest `kind` job of `release` succeeded (as its agent would say)."""
    job = Job.objects.filter(release=release, kind=kind).order_by("-id").first()
    do_finish_job(job or do_dispatch_job(release, kind), result={})


def test_a_reopened_release_runs_its_stages_again_whatever_the_audit_log_says(
    release, owner
):
    for kind in ("verify_source", "compress", "sign", "verify"):  # the first pass
        do_finish_job(do_dispatch_job(release, kind), result={})
    do_transition_release(release, "failed", actor=owner, reason="evaluate failed")
    do_reopen_release(release, owner, reason="recalibrated")
    run_promotion(release.pk)
    finish(release, "verify_source")
    assert run_promotion(release.pk) == "compressing"
    finish(release, "compress")
    erase_audit_log()  # the record of when this pass entered compressing

    state = run_promotion(release.pk)

    # The first pass's sign and verify are no evidence for this pass's bytes.
    assert state == "compressing"
    signs = Job.objects.filter(release=release, kind="sign").order_by("id")
    assert [j.state for j in signs] == ["succeeded", "queued"]


def test_missing_evidence_is_inconclusive_and_pauses_in_gated(make_release):
    release = make_release(state="gated")

    assert run_promotion(release.pk) == "gated"

    outcomes = {g.gate: g.outcome for g in release.gate_results.all()}
    assert outcomes == {
        "integrity": "inconclusive",
        "quality": "inconclusive",
        "load": "inconclusive",
    }
    gate = Job.objects.get(release=release, kind="gate")
    assert gate.result["outcome"] == "inconclusive"


def test_a_duplicate_result_message_changes_nothing(bf16_release, local_agent):
    run_promotion(bf16_release.pk)
    (message, request), *_ = local_agent.pending("verify_source")
    result = local_agent.tasks.execute(request, local_agent.agent, timezone.now())
    local_agent.record(message, request, result)
    before = (
        list(Job.objects.order_by("id").values()),
        AuditEvent.objects.count(),
        Release.objects.get(pk=bf16_release.pk).state,
    )

    # sealed anew (an agent's retry): counted once
    again = local_agent.record(message, request, result)

    assert again == "ignored"
    after = (
        list(Job.objects.order_by("id").values()),
        AuditEvent.objects.count(),
        Release.objects.get(pk=bf16_release.pk).state,
    )
    assert after == before


def test_it_fails_verification_on_a_pickle_and_names_the_file(
    make_release, model_folder, local_agent
):
    (model_folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    release = make_release(source_uri=model_folder.as_uri(), recipe=BF16)
    run_promotion(release.pk)

    local_agent.work()

    stored = Release.objects.get(pk=release.pk)
    assert stored.state == "failed_verification"
    assert "pytorch_model.bin" in stored.failure_reason
    assert str(model_folder) not in stored.failure_reason  # no host paths
    assert not Job.objects.filter(release=release, kind="compress").exists()


def test_it_fails_a_release_whose_recipe_the_compressor_cannot_apply(
    make_release, model_folder, local_agent
):
    recipe = {"weights": "int8", "kv_cache_dtype": "int8", "symmetric": False}
    release = make_release(source_uri=model_folder.as_uri(), recipe=recipe)
    run_promotion(release.pk)

    local_agent.work()

    stored = Release.objects.get(pk=release.pk)
    assert stored.state == "failed"
    assert "symmetric=false is only offered for int4" in stored.failure_reason
    assert Job.objects.get(release=release, kind="compress").state == "failed"


def test_the_recipes_head_reaches_the_compress_job_and_the_candidate(
    make_release, model_folder, local_agent
):
    recipe = {"weights": "w4a16-g128", "kv_cache_dtype": "int8", "head": "int8"}
    release = make_release(source_uri=model_folder.as_uri(), recipe=recipe)
    run_promotion(release.pk)
    local_agent.work(kinds=("verify_source",))
    [(_, request)] = local_agent.pending("compress")

    local_agent.work()

    release.refresh_from_db()
    assert release.state == "evaluating", release.failure_reason
    assert request.recipe.head == "int8"
    job = Job.objects.get(release=release, kind="compress")
    assert job.result["report"]["recipe"]["head"] == "int8"
    candidate = local_agent.agent.store.path_of(job.result["candidate"])
    config = json.loads((candidate / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    groups = config["quantization_config"]["config_groups"].values()
    [head] = [g for g in groups if g["targets"] == ["re:^lm_head$"]]
    assert (head["weights"]["num_bits"], head["weights"]["group_size"]) == (8, 32)


def silence(agent: Agent) -> None:
    Agent.objects.filter(pk=agent.pk).update(
        last_heartbeat=timezone.now() - timedelta(minutes=5)
    )


def test_the_watch_resends_the_job_of_a_silent_agent_and_ignores_its_late_result(
    bf16_release, local_agent
):
    run_promotion(bf16_release.pk)
    (message, request), *_ = local_agent.pending("verify_source")
    local_agent.tasks.report_progress(request, 0.1)  # taken by "local"
    late = local_agent.tasks.execute(request, local_agent.agent, timezone.now())
    silence(local_agent.row)

    assert watch_jobs()["retried"] == 1

    job = Job.objects.get(release=bf16_release, kind="verify_source")
    assert (job.state, job.attempts, job.agent) == ("queued", 2, None)
    assert "agent local stopped sending heartbeats" in job.error
    assert Agent.objects.get(pk=local_agent.row.pk).state == "offline"
    assert local_agent.record(message, request, late) == "ignored"
    (_, resent), *_ = local_agent.pending("verify_source")
    assert resent.attempt == 2


def test_the_watch_fails_the_release_after_the_last_attempt(
    bf16_release, local_agent, settings
):
    settings.RELEASEGATE_JOB_MAX_ATTEMPTS = 2
    run_promotion(bf16_release.pk)
    for _ in range(2):
        (_, request), *_ = local_agent.pending("verify_source")
        local_agent.tasks.report_progress(request, 0.1)
        local_agent.taken.update(m.pk for m, _ in local_agent.pending())
        silence(local_agent.row)
        watch_jobs()
        Agent.objects.filter(pk=local_agent.row.pk).update(state="online")

    stored = Release.objects.get(pk=bf16_release.pk)
    assert stored.state == "failed_verification"
    assert "stopped sending heartbeats; gave up after 2 attempt(s)" in (
        stored.failure_reason
    )


def test_the_watch_resends_a_job_no_agent_took_in_time(bf16_release, local_agent):
    run_promotion(bf16_release.pk)
    Job.objects.filter(release=bf16_release).update(
        lease_expires=timezone.now() - timedelta(seconds=1)
    )

    assert watch_jobs()["retried"] == 1

    assert "no agent took it within" in Job.objects.get(release=bf16_release).error


def test_a_restarted_agent_gets_the_job_of_its_earlier_incarnation_again_at_once(
    bf16_release, local_agent
):
    record_heartbeat(*local_agent.beat(local_agent.agent.incarnation))
    run_promotion(bf16_release.pk)
    (message, request), *_ = local_agent.pending("verify_source")
    local_agent.tasks.report_progress(request, 0.1)  # taken by "local"
    late = local_agent.tasks.execute(request, local_agent.agent, timezone.now())

    # Killed and started again: its next beat is another incarnation's, long
    # before AGENT_DEAD_AFTER_S.
    assert record_heartbeat(*local_agent.beat(uuid.uuid4().hex)) == "online"

    job = Job.objects.get(release=bf16_release, kind="verify_source")
    assert (job.state, job.attempts, job.agent) == ("queued", 2, None)
    assert "agent local restarted" in job.error
    retried = AuditEvent.objects.get(verb="job.retried", object_id=str(job.pk))
    assert retried.after["attempts"] == 2
    assert retried.before["agent"] == "local"
    assert local_agent.record(message, request, late) == "ignored"
    (_, resent), *_ = local_agent.pending("verify_source")
    assert resent.attempt == 2


def test_a_restart_resends_what_the_earlier_incarnation_reported_and_no_more(
    bf16_release, local_agent
):
    first = local_agent.agent.incarnation
    run_promotion(bf16_release.pk)
    (message, request), *_ = local_agent.pending("verify_source")
    # Taken: its last beat says so, its progress report was lost with it.
    record_heartbeat(*local_agent.beat(first, running_jobs=[request.job_id]))
    record_heartbeat(*local_agent.beat(first, running_jobs=[request.job_id]))
    job = Job.objects.get(pk=request.job_id)
    assert (job.state, job.attempts) == ("queued", 1)  # the same incarnation

    second = uuid.uuid4().hex
    record_heartbeat(*local_agent.beat(second))

    job.refresh_from_db()
    assert (job.state, job.attempts) == ("queued", 2)
    local_agent.taken.add(message.pk)
    (message, request), *_ = local_agent.pending("verify_source")
    local_agent.tasks.report_progress(request, 0.1)  # the new one takes it
    record_heartbeat(*local_agent.beat(second, running_jobs=[request.job_id]))
    record_heartbeat(*local_agent.beat(uuid.uuid4().hex, running_jobs=[request.job_id]))
    job.refresh_from_db()
    # still attempt 2: the newest incarnation says it runs it
    assert (job.state, job.attempts) == ("running", 2)


def test_a_restart_after_the_watch_sent_the_job_away_sends_it_no_more(
    bf16_release, local_agent
):
    first = local_agent.agent.incarnation
    run_promotion(bf16_release.pk)
    (_, request), *_ = local_agent.pending("verify_source")
    local_agent.tasks.report_progress(request, 0.1)
    record_heartbeat(*local_agent.beat(first, running_jobs=[request.job_id]))
    silence(local_agent.row)
    assert watch_jobs()["retried"] == 1  # offline: attempt 2 is queued

    record_heartbeat(*local_agent.beat(uuid.uuid4().hex))

    job = Job.objects.get(pk=request.job_id)
    assert (job.state, job.attempts) == ("queued", 2)
    assert Agent.objects.get(pk=local_agent.row.pk).state == "online"


@pytest.fixture
def approved(bf16_release, local_agent, teammate):
    promote_to_approval(bf16_release, local_agent)
    do_approve_release(bf16_release, teammate)
    return bf16_release


def test_it_deploys_through_the_agent_and_goes_live(approved, local_agent):
    assert run_deployment(approved.pk) == "deploying"
    (_, request), *_ = local_agent.pending("deploy")
    assert request.manifest_digest == approved.approvals.get().manifest_digest

    local_agent.answer(
        "deploy",
        DeployResult(ok=True, endpoint="http://127.0.0.1:9", pid=1),
    )

    deployment = Deployment.objects.get(release=approved)
    assert (deployment.state, deployment.endpoint) == ("live", "http://127.0.0.1:9")
    assert deployment.agent.name == "local"
    assert Release.objects.get(pk=approved.pk).state == "live"
    assert run_deployment(approved.pk) == "live"  # idempotent
    assert Job.objects.filter(release=approved, kind="deploy").count() == 1


def test_a_deploy_that_finds_other_bytes_fails_verification(approved, local_agent):
    run_deployment(approved.pk)
    candidate = local_agent.agent.store.path_of(
        Job.objects.get(release=approved, kind="compress").result["candidate"]
    )
    (candidate / "config.json").write_text('{"model_type": "evil"}')

    local_agent.work(kinds=("deploy",))  # the real handler: refuses before serving

    stored = Release.objects.get(pk=approved.pk)
    assert stored.state == "failed_verification"
    assert "config.json" in stored.failure_reason
    assert Deployment.objects.get(release=approved).state == "failed_verification"
    assert Job.objects.get(release=approved, kind="deploy").result["changed"] == [
        "config.json"
    ]


@pytest.mark.parametrize(
    ("error_code", "error", "state"),
    [
        # The words say mismatch, the code says the bytes were the approved ones.
        ("recipe-mismatch", "recipe weights=int4-g128 mismatch: config.json", "failed"),
        # The words don't, the code says the folder changed under the server.
        (
            "changed-during-start",
            "the folder changed after the agent's check: server exited",
            "failed_verification",
        ),
    ],
)
def test_a_failed_deploy_fails_verification_by_its_code_not_its_words(
    make_release, local_agent, error_code, error, state
):
    release = make_release(state="approved")
    run_deployment(release.pk)

    local_agent.answer(
        "deploy",
        DeployResult(ok=False, error=error, error_code=error_code),
        error=error,
    )

    assert Release.objects.get(pk=release.pk).state == state
    assert Deployment.objects.get(release=release).state == state


def test_reverification_of_a_tampered_copy_marks_the_deployment(approved, local_agent):
    run_deployment(approved.pk)
    local_agent.answer("deploy", DeployResult(ok=True, endpoint="http://x:1"))
    deployment = Deployment.objects.get(release=approved)

    run_reverification(deployment.pk)
    assert run_reverification(deployment.pk) == "busy"  # one re-hash at a time
    local_agent.answer(
        "reverify",
        VerifyResult(ok=False, manifest_digest="", changed=["config.json"]),
        error="manifest mismatch; changed: config.json",
    )

    deployment.refresh_from_db()
    assert deployment.state == "failed_verification"
    stored = Release.objects.get(pk=approved.pk)
    assert stored.state == "failed_verification"
    assert "changed: config.json" in stored.failure_reason
