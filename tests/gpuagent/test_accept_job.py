"""An agent runs only job requests the control plane sealed (gpuagent.tasks
accept_job / run_job): unsigned, forged, stale, altered or re-bound requests are
refused, logged and not run."""

import logging
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpuagent import tasks, worker
from gpuagent.artifacts import ArtifactStore
from gpuagent.integrity import identity
from gpuagent.protocol import JobRequest, Recipe

CONTROLPLANE = Ed25519PrivateKey.generate()


@pytest.fixture
def me(tmp_path) -> tasks.Agent:
    return tasks.Agent(
        name="gpu-1",
        store=ArtifactStore(tmp_path / "artifacts"),
        signing_key=None,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
        controlplane_keys=(identity.public_raw(CONTROLPLANE),),
    )


def job(**fields) -> dict:
    request = JobRequest(
        job_id=7,
        release_id=3,
        kind="verify_source",
        attempt=1,
        source_uri="file:///srv/models/llama",
        recipe=Recipe(weights="bf16", kv_cache_dtype="int8"),
        **fields,
    )
    return request.model_dump(mode="json")


def sealed(body: dict, key=CONTROLPLANE, **fields) -> dict:
    binding = {
        "type": "job",
        "job_id": body["job_id"],
        "attempt": body["attempt"],
        "kind": body["kind"],
        "release_id": body["release_id"],
        **fields,
    }
    return identity.seal(key, body, **binding).model_dump(mode="json")


def test_it_accepts_a_request_the_control_plane_sealed(me):
    body = job()

    accepted = tasks.accept_job(body, sealed(body), me)

    assert (accepted.job_id, accepted.kind) == (7, "verify_source")


def refusal(body, seal, me) -> str:
    with pytest.raises(tasks.JobRefused) as refused:
        tasks.accept_job(body, seal, me)
    return str(refused.value)


def test_it_refuses_an_unsigned_request(me):
    assert refusal(job(), None, me) == "unsigned job request"


def test_it_refuses_a_request_sealed_by_another_key(me):
    body = job()

    why = refusal(body, sealed(body, key=Ed25519PrivateKey.generate()), me)

    assert why.startswith("job request sealed by an unknown key")


def test_it_refuses_a_forged_signature_under_the_control_planes_fingerprint(me):
    body = job()
    seal = sealed(body, key=Ed25519PrivateKey.generate())
    seal["signer"] = identity.fingerprint(identity.public_raw(CONTROLPLANE))

    assert (
        refusal(body, seal, me) == "job request refused: the signature does not verify"
    )


def test_it_refuses_a_request_altered_after_sealing(me):
    body = job()
    seal = sealed(body)
    body["source_uri"] = "file:///etc"  # read any local path as a "source"

    why = refusal(body, seal, me)

    assert why == "job request refused: the seal was made over another message body"


def test_it_refuses_a_seal_bound_to_another_job(me):
    other = job()
    body = {**other, "job_id": 8}

    why = refusal(body, sealed(other), me)

    # the body hash differs too; a seal bound to job 7 over job 8's body:
    assert why.startswith("job request refused:")
    rebound = sealed(body, job_id=7)
    assert refusal(body, rebound, me) == (
        "job request refused: the seal binds job_id=7, the message 8"
    )


def test_it_refuses_a_stale_request(me):
    body = job()
    seal = identity.seal(
        CONTROLPLANE,
        body,
        type="job",
        job_id=7,
        attempt=1,
        kind="verify_source",
        release_id=3,
        now=time.time() - me.job_max_age_s - 1,
    ).model_dump(mode="json")

    assert "stale" in refusal(body, seal, me)


def test_an_agent_that_trusts_no_control_plane_key_runs_nothing(me):
    me.controlplane_keys = ()
    body = job()

    assert refusal(body, sealed(body), me) == "this agent trusts no control-plane key"


def test_run_job_neither_runs_nor_answers_a_refused_request(me, monkeypatch, caplog):
    ran, sent = [], []
    monkeypatch.setattr(worker, "_agent", me)
    monkeypatch.setitem(tasks.HANDLERS, "verify_source", lambda *a: ran.append(a))
    monkeypatch.setattr(tasks, "send_to_controlplane", lambda *a: sent.append(a))

    with caplog.at_level(logging.ERROR):
        answer = tasks.run_job(job())

    assert answer == {"refused": "unsigned job request"}
    assert (ran, sent) == ([], [])
    assert "refused a job request (job 7): unsigned job request" in caplog.text
