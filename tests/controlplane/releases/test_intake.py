"""Where agent messages arrive (controlplane.releases.intake): with broker access
alone, forged results, heartbeats and progress reports change nothing; a result
is believed only sealed by the enrolled agent that took its job, fresh, never
seen, bound to its job; a sign result only with a signature the signer's
enrolled key made for this release; a verify result only from another agent
than the signer; a revoked agent's messages are refused and its jobs sent
elsewhere. Every refusal is audited."""

import shutil
import time
from pathlib import Path

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Agent, EnrollmentRequest
from controlplane.fleet.tasks import record_heartbeat
from controlplane.releases.intake import revoke_agent
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import (
    record_job_progress,
    record_job_result,
    run_promotion,
)
from gpuagent import tasks
from gpuagent.artifacts import ArtifactStore
from gpuagent.integrity import identity
from gpuagent.integrity.keys import ensure_key_pair
from gpuagent.protocol import HashResult, InspectResult, JobResult
from tests.controlplane.conftest import sealed_beat
from tests.controlplane.releases.test_pipeline import BF16, DEMO_MODEL


@pytest.fixture
def bf16_release(make_release, make_source):
    """A release of a copy of the demo model (compressed and signed for real)."""
    folder = make_source("model")
    for path in DEMO_MODEL.iterdir():
        if path.is_file():
            shutil.copyfile(path, folder / path.name)
    return make_release(source_uri=folder.as_uri(), recipe=BF16)


def refusals() -> list[str]:
    return list(
        AuditEvent.objects.filter(verb="agent.message_refused")
        .order_by("id")
        .values_list("after__reason", flat=True)
    )


def forger(tmp_path: Path, name: str = "local") -> tasks.Agent:
    """Someone with broker access and a key of their own, calling itself `name`."""
    return tasks.Agent(
        name=name,
        store=ArtifactStore(tmp_path / f"forger-{name}"),
        signing_key=None,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
    )


def forged_result(request, kind: str, payload) -> JobResult:
    return JobResult(
        job_id=request.job_id,
        kind=kind,
        ok=True,
        agent="local",
        started=timezone.now(),
        finished=timezone.now(),
        payload=payload.model_dump(mode="json"),
    )


def test_forged_messages_change_nothing_without_an_enrolled_agent(
    bf16_release, queued, tmp_path
):
    from gpuagent.protocol import JobRequest

    assert run_promotion(bf16_release.pk) == "verifying"
    (body, _seal), *_ = queued("run_job")
    request = JobRequest.model_validate(body)
    result = forged_result(request, "verify_source", InspectResult(ok=True))
    mallory = forger(tmp_path)
    unsigned_beat, _ = sealed_beat(mallory, can_sign=True)

    outcomes = [
        # unsigned, as every message was before enrollment
        record_job_result(result.model_dump(mode="json"), request.attempt),
        record_heartbeat(unsigned_beat),
        record_job_progress(request.job_id, request.attempt, "local", 0.5),
        # sealed by a key of its own: its beat files a request, nothing more
        record_heartbeat(*sealed_beat(mallory, can_sign=True)),
        record_job_result(*tasks.sealed_result(result, request, mallory)),
        record_job_progress(*tasks.sealed_progress(request, 0.5, mallory)),
    ]

    assert outcomes == ["refused", "refused", False, "pending", "refused", False]
    job = Job.objects.get(pk=request.job_id)
    assert (job.state, job.agent, job.progress) == ("queued", None, 0.0)
    assert Release.objects.get(pk=bf16_release.pk).state == "verifying"
    assert not Agent.objects.exists()
    assert EnrollmentRequest.objects.get().state == "pending"
    assert refusals() == [
        "unsigned message",
        "unsigned message",
        "unsigned message",
        "sealed by a key no agent is enrolled with",
        "sealed by a key no agent is enrolled with",
    ]


def take(local_agent, kind: str):
    """The queued `kind` job, taken by its agent (progress reported)."""
    (message, request), *_ = local_agent.pending(kind)
    local_agent.tasks.report_progress(request, 0.1)
    return message, request


def test_a_result_sealed_by_another_enrolled_agent_than_the_jobs_is_refused(
    bf16_release, local_agent
):
    run_promotion(bf16_release.pk)
    message, request = take(local_agent, "verify_source")  # "local" runs it
    result = local_agent.tasks.execute(request, local_agent.agent, timezone.now())

    outcome = local_agent.record(message, request, result, local_agent.checker)

    assert outcome == "refused"
    job = Job.objects.get(pk=request.job_id)
    assert (job.state, job.agent.name) == ("running", "local")
    assert refusals() == [f"job {job.pk} runs on agent local, not checker"]
    # the agent that took it is believed
    assert local_agent.record(message, request, result) == "succeeded"


def test_a_replayed_result_is_refused(bf16_release, local_agent):
    run_promotion(bf16_release.pk)
    message, request = take(local_agent, "verify_source")
    result = local_agent.tasks.execute(request, local_agent.agent, timezone.now())
    sent = tasks.sealed_result(result, request, local_agent.agent)
    assert record_job_result(*sent) == "succeeded"

    assert record_job_result(*sent) == "refused"

    assert refusals() == ["replayed: this message was seen before"]


def test_a_replayed_heartbeat_and_progress_report_are_refused(
    bf16_release, local_agent
):
    run_promotion(bf16_release.pk)
    (_, request), *_ = local_agent.pending("verify_source")
    beat = local_agent.beat(local_agent.agent.incarnation)
    progress = tasks.sealed_progress(request, 0.2, local_agent.agent)
    assert record_heartbeat(*beat) == "online"
    assert record_job_progress(*progress) is True

    assert record_heartbeat(*beat) == "refused"
    assert record_job_progress(*progress) is False

    assert refusals() == ["replayed: this message was seen before"] * 2


@pytest.mark.parametrize("skew_s", [-400, 400])
def test_a_stale_or_future_result_is_refused(bf16_release, local_agent, skew_s):
    run_promotion(bf16_release.pk)
    message, request = take(local_agent, "verify_source")
    result = local_agent.tasks.execute(request, local_agent.agent, timezone.now())
    body = result.model_dump(mode="json")
    sealed = identity.seal(
        local_agent.agent.identity,
        body,
        type="result",
        job_id=request.job_id,
        attempt=request.attempt,
        kind=request.kind,
        release_id=request.release_id,
        now=time.time() + skew_s,
    )

    assert record_job_result(body, request.attempt, sealed.model_dump()) == "refused"

    (reason,) = refusals()
    assert reason.startswith("stale: sealed") and "at most 300 s" in reason
    assert Job.objects.get(pk=request.job_id).state == "running"


def test_mis_bound_results_are_refused(bf16_release, local_agent):
    run_promotion(bf16_release.pk)
    message, request = take(local_agent, "verify_source")
    result = local_agent.tasks.execute(request, local_agent.agent, timezone.now())
    body, attempt, sealed = tasks.sealed_result(result, request, local_agent.agent)
    other_release = request.model_copy(update={"release_id": request.release_id + 1})
    tampered = {**body, "payload": {**body["payload"], "manifest_digest": "sha256:0"}}

    outcomes = [
        # the attempt the seal binds is not the one the message says
        record_job_result(body, 2, sealed),
        # another body under the seal
        record_job_result(tampered, attempt, sealed),
        # sealed for another release's job of the same id
        record_job_result(
            *tasks.sealed_result(result, other_release, local_agent.agent)
        ),
    ]

    assert outcomes == ["refused"] * 3
    reasons = refusals()
    assert reasons[0] == "the seal binds attempt=1, the message 2"
    assert reasons[1] == "the seal was made over another message body"
    assert reasons[2].startswith(f"sealed for release {request.release_id + 1}")
    assert Job.objects.get(pk=request.job_id).state == "running"


def signed_job(bf16_release, local_agent):
    """Up to the sign job, taken by the signer."""
    run_promotion(bf16_release.pk)
    local_agent.work(kinds=("verify_source", "compress"))
    return take(local_agent, "sign")


def test_a_sign_result_with_a_signature_of_another_key_is_refused(
    bf16_release, local_agent, tmp_path
):
    message, request = signed_job(bf16_release, local_agent)
    # the same candidate signed with a key the signer was not enrolled with
    rogue_key = tmp_path / "rogue.pem"
    ensure_key_pair(rogue_key)
    rogue = tasks.Agent(
        name="local",
        store=local_agent.agent.store,
        signing_key=rogue_key,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
    )
    forged = local_agent.tasks.execute(request, rogue, timezone.now())
    assert forged.ok, forged.error

    assert local_agent.record(message, request, forged) == "refused"

    (reason,) = refusals()
    assert "does not verify against local's enrolled signing key" in reason
    release = Release.objects.get(pk=bf16_release.pk)
    assert (release.manifest_digest, release.signature) == ("", "")
    assert Job.objects.get(pk=request.job_id).state == "running"


def test_a_sign_result_reporting_another_digest_than_it_signs_is_refused(
    bf16_release, local_agent
):
    message, request = signed_job(bf16_release, local_agent)
    result = local_agent.tasks.execute(request, local_agent.agent, timezone.now())
    signed = HashResult.model_validate(result.payload)
    lying = result.model_copy(
        update={
            "payload": signed.model_copy(
                update={"manifest_digest": "sha256:" + "ab" * 32}
            ).model_dump(mode="json")
        }
    )

    assert local_agent.record(message, request, lying) == "refused"

    (reason,) = refusals()
    assert reason.startswith(f"the signature signs {signed.manifest_digest}")
    assert Release.objects.get(pk=bf16_release.pk).manifest_digest == ""


def test_a_sign_result_for_another_release_binding_is_refused(
    bf16_release, local_agent
):
    message, request = signed_job(bf16_release, local_agent)
    # signed for version 9.9 of the model, answered for this release's job
    other = request.model_copy(update={"version": "9.9"})
    result = local_agent.tasks.execute(other, local_agent.agent, timezone.now())

    assert local_agent.record(message, request, result) == "refused"

    (reason,) = refusals()
    assert "version" in reason and "9.9" in reason
    assert Release.objects.get(pk=bf16_release.pk).manifest_digest == ""


def test_a_sign_result_from_an_agent_not_enrolled_to_sign_is_refused(
    bf16_release, local_agent
):
    run_promotion(bf16_release.pk)
    local_agent.work(kinds=("verify_source", "compress"))
    (message, request), *_ = local_agent.pending("sign")
    result = local_agent.tasks.execute(request, local_agent.agent, timezone.now())

    outcome = local_agent.record(message, request, result, local_agent.checker)

    assert outcome == "refused"
    assert refusals() == ["agent checker is not enrolled to sign"]


def test_a_verify_by_the_signer_is_refused_and_sent_to_another_agent(
    bf16_release, local_agent
):
    run_promotion(bf16_release.pk)
    local_agent.work(kinds=("verify_source", "compress", "sign"))
    (message, request), *_ = local_agent.pending("verify")
    own = local_agent.tasks.execute(request, local_agent.agent, timezone.now())
    assert own.ok, own.error

    assert local_agent.record(message, request, own, local_agent.agent) == "refused"

    assert refusals() == [
        "verify must run on another enrolled agent than the signer (local)"
    ]
    job = Job.objects.get(pk=request.job_id)
    assert (job.state, job.attempts) == ("queued", 2)
    local_agent.work(kinds=("verify",))  # the checker's is believed
    assert Release.objects.get(pk=bf16_release.pk).state == "evaluating"


def test_a_heartbeat_changes_no_name_queue_pool_or_capability(local_agent):
    claims = sealed_beat(
        local_agent.checker,
        agent="local",
        queue="agent.local",
        pool_queue="sign-pool",
        can_sign=True,
    )

    assert record_heartbeat(*claims) == "online"

    checker = Agent.objects.get(fingerprint=local_agent.checker.fingerprint)
    assert (checker.name, checker.queue, checker.can_sign) == (
        "checker",
        "agent.checker",
        False,
    )
    assert checker.capabilities == {"can_sign": False, "pool_queue": "agents"}
    local = Agent.objects.get(name="local")
    assert local.fingerprint == local_agent.agent.fingerprint


def test_revoking_an_agent_refuses_it_at_once_and_resends_its_jobs(
    bf16_release, local_agent
):
    run_promotion(bf16_release.pk)
    message, request = take(local_agent, "verify_source")
    result = local_agent.tasks.execute(request, local_agent.agent, timezone.now())

    revoke_agent(local_agent.row, actor="system:tests")

    job = Job.objects.get(pk=request.job_id)
    assert (job.state, job.attempts, job.agent) == ("queued", 2, None)
    assert "agent local was revoked" in job.error
    assert local_agent.record(message, request, result) == "refused"
    assert record_heartbeat(*local_agent.beat(local_agent.agent.incarnation)) == (
        "refused"
    )
    assert Agent.objects.get(name="local").state == "offline"
    assert refusals() == ["agent local is revoked"] * 2


def test_unknown_keys_beyond_the_limit_file_no_request(db, settings, tmp_path):
    settings.RELEASEGATE_MAX_PENDING_ENROLLMENTS = 1

    first = record_heartbeat(*sealed_beat(forger(tmp_path, "a")))
    second = record_heartbeat(*sealed_beat(forger(tmp_path, "b")))

    assert (first, second) == ("pending", "refused")
    assert EnrollmentRequest.objects.count() == 1
    assert refusals() == ["too many enrollments pending"]


def test_a_beat_sealed_by_another_key_than_it_presents_files_no_request(db, tmp_path):
    mallory, victim = forger(tmp_path, "mallory"), forger(tmp_path, "victim")
    beat, _ = sealed_beat(victim)
    sealed = identity.seal(mallory.identity, beat, type="heartbeat")

    assert record_heartbeat(beat, sealed.model_dump(mode="json")) == "refused"

    assert not EnrollmentRequest.objects.exists()
    (reason,) = refusals()
    assert reason.startswith("sealed by a key no agent is enrolled with")


def test_a_malformed_seal_is_refused(bf16_release, local_agent):
    beat, seal = local_agent.beat(local_agent.agent.incarnation)

    assert record_heartbeat(beat, {**seal, "nonce": "not hex"}) == "refused"

    (reason,) = refusals()
    assert reason.startswith("malformed seal")
