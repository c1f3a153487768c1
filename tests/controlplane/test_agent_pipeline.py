"""The pipeline across real processes: a control-plane Celery worker (with beat)
and two agents started as `python -m gpuagent run` (separate processes), against
the database and broker the test settings point at (PostgreSQL + Redis when
DATABASE_URL/CELERY_BROKER_URL say so, else the embedded SQLite + SQLAlchemy
transport). The "signer" agent holds the signing key, the "checker" only its public
key, so verification runs on another agent than signing. Queues are the test's
own, so other workers on the same broker take nothing of it."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from controlplane import celery_app
from controlplane.accounts.models import ApiToken
from controlplane.celery import dies_with_this_process, worker_command
from controlplane.fleet.enrollment import do_enroll_agent
from controlplane.fleet.keys import write_controlplane_public_key
from controlplane.fleet.models import Agent, EnrollmentRequest
from controlplane.releases.actions.gate_policies import do_set_gate_policy
from gpuagent.integrity.keys import ensure_key_pair
from gpuagent.serving import Registry, loaded_deployments, undeploy
from tests.controlplane.test_worker_integration import database_url

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "gpuagent" / "engine" / "demo_model"
RECIPE = {"weights": "bf16", "kv_cache_dtype": "int8"}
AGENT_TIMEOUT_S = 6
AGENT_CHECK_S = 2
# Gate on every slice and workload the default policy names. The latency limits
# are loose because this checks the pipeline on a shared CPU, not the CPU's speed;
# the 3.2M-parameter demo model retrieves no planted fact (its parent neither), so
# retrieval is not required of it.
POLICY = {
    "quality": {"require_retrieval": False},
    "load": {"thresholds": {"max_ttft_p99_ms": 60000, "max_tpot_p99_ms": 10000}},
}


class Cluster:
    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.artifacts = tmp_path / "artifacts"
        self.key = tmp_path / "keys" / "signer.pem"
        self.public_key = ensure_key_pair(self.key)
        suffix = uuid.uuid4().hex[:8]
        self.queue = f"cp-{suffix}"
        self.pool = f"pool-{suffix}"
        self.dead_after_s = AGENT_TIMEOUT_S
        # The control plane's public key, given to the agents (its private key is
        # the test session's: settings.RELEASEGATE_CONTROLPLANE_KEY).
        self.controlplane_public = write_controlplane_public_key(
            tmp_path / "keys" / "controlplane.pub.pem"
        )
        self.allow_verify_on_signer = False

    def env(self) -> dict:
        return {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "DATABASE_URL": database_url(),
            "CELERY_BROKER_URL": celery_app.conf.broker_url,
            "CELERY_RESULT_BACKEND": str(celery_app.conf.result_backend),
            "RELEASEGATE_SOURCE_ROOTS": ",".join(
                str(r) for r in settings.RELEASEGATE_SOURCE_ROOTS
            ),
            "RELEASEGATE_AGENT_POOL_QUEUE": self.pool,
            "CELERY_TASK_DEFAULT_QUEUE": self.queue,  # beat's tasks too
            "AGENT_DEAD_AFTER_S": str(self.dead_after_s),
            "RELEASEGATE_AGENT_CHECK_S": str(AGENT_CHECK_S),
            "GPUAGENT_HEARTBEAT_S": "1",
            "OMP_NUM_THREADS": "1",
            "RELEASEGATE_CONTROLPLANE_KEY": str(settings.RELEASEGATE_CONTROLPLANE_KEY),
            "RELEASEGATE_ALLOW_VERIFY_ON_SIGNER": str(self.allow_verify_on_signer),
        }

    def start(self, name: str, command: list[str], ready: bytes) -> None:
        """Start `name` (again: its log goes on) and wait for `ready` in its log."""
        log_path = self.tmp / f"{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            self.processes[name] = subprocess.Popen(
                command,
                cwd=ROOT,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=dies_with_this_process(),
            )
        self.logs[name] = log_path
        deadline = time.monotonic() + 90
        while ready not in log_path.read_bytes()[offset:]:
            assert self.processes[name].poll() is None, self.log_tail()
            assert time.monotonic() < deadline, self.log_tail()
            time.sleep(0.2)

    def start_controlplane(self) -> None:
        command = worker_command(
            "--without-heartbeat",
            f"--queues={self.queue}",
            "--beat",
            f"--schedule={self.tmp / 'beat-schedule'}",
        )
        self.start("controlplane", command, b"ready.")

    def start_agent(self, name: str, *, signer: bool) -> None:
        command = [
            sys.executable,
            "-m",
            "gpuagent",
            "run",
            "--name",
            name,
            "--broker",
            celery_app.conf.broker_url,
            "--artifacts",
            str(self.artifacts),
            "--pool",
            self.pool,
            "--controlplane-queue",
            self.queue,
            *(("--signing-key", str(self.key)) if signer else ()),
            "--trusted-key",
            str(self.public_key),
            "--controlplane-key",
            str(self.controlplane_public),
            "--state-dir",
            str(self.tmp / "state" / name),
        ]
        self.start(name, command, b"ready.")

    def wait_for_agents(self, *names: str) -> None:
        """Enroll the agents `names` (as an operator would: each one's pending
        request, the signer's may sign), then wait until each beats online."""
        deadline = time.monotonic() + 60
        for name in names:
            if Agent.objects.filter(name=name, enrollment="enrolled").exists():
                continue
            while not (
                request := EnrollmentRequest.objects.filter(
                    requested_name=name, state="pending"
                ).first()
            ):
                assert time.monotonic() < deadline, self.log_tail()
                time.sleep(0.2)
            do_enroll_agent(
                request,
                actor="system:tests",
                name=name,
                pool_queue=self.pool,
                can_sign=bool(request.signing_public_key),
            )
        while set(
            Agent.objects.filter(name__in=names, state="online").values_list(
                "name", flat=True
            )
        ) != set(names):
            assert time.monotonic() < deadline, self.log_tail()
            time.sleep(0.2)

    def kill(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {name}\n{path.read_text(errors='replace')[-3000:]}"
            for name, path in self.logs.items()
        )


def complete(endpoint: str, model: str, max_tokens: int = 4) -> dict:
    """A chat completion of `model` from the server at `endpoint` (asserted 200)."""
    completion = httpx.post(
        f"{endpoint}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": max_tokens,
        },
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    return completion.json()


def stop_servers(cluster: "Cluster") -> None:
    """The servers the deploy jobs started outlive their agents: stop every one
    the agents' serving registry records."""
    registry = Registry(cluster.artifacts / "serving")
    for info in loaded_deployments(registry):
        undeploy(info.deployment_id, registry=registry, grace_s=5)


@pytest.fixture
def cluster(tmp_path, settings):
    cluster = Cluster(tmp_path)
    default_queue = celery_app.conf.task_default_queue
    celery_app.conf.task_default_queue = cluster.queue
    settings.RELEASEGATE_AGENT_POOL_QUEUE = cluster.pool
    settings.AGENT_DEAD_AFTER_S = AGENT_TIMEOUT_S
    try:
        yield cluster
    finally:
        celery_app.conf.task_default_queue = default_queue
        cluster.stop()


def wait_for_state(release, states, cluster, timeout_s=300) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        release.refresh_from_db()
        if release.state in states:
            return time.monotonic() - started
        time.sleep(0.3)
    jobs = list(release.jobs.values_list("kind", "state", "attempts", "error"))
    pytest.fail(f"{release} still {release.state}; jobs {jobs}\n{cluster.log_tail()}")


@pytest.fixture
def demo_release(make_release, make_source, owner):
    source = make_source("demo")
    source.rmdir()
    shutil.copytree(DEMO_MODEL, source)
    release = make_release(source_uri=source.as_uri(), recipe=RECIPE)
    do_set_gate_policy(release.target_environment, POLICY, actor=owner)
    return release


def api(client, token, method, path, body=None):
    kwargs = {"headers": {"authorization": f"Bearer {token}"}}
    if body is not None:
        kwargs.update(data=body, content_type="application/json")
    return getattr(client, method)(f"/api/v1{path}", **kwargs)


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.django_db(transaction=True)
def test_it_takes_a_release_from_registration_to_live_on_agents(
    cluster, demo_release, client, owner, teammate
):
    release = demo_release
    cluster.start_controlplane()
    cluster.start_agent("signer", signer=True)
    cluster.start_agent("checker", signer=False)
    cluster.wait_for_agents("signer", "checker")
    _, ci = ApiToken.create(owner, release.team, "ci", ["read", "promote"])
    _, approver = ApiToken.create(teammate, release.team, "ap", ["read", "approve"])

    promoted = api(client, ci, "post", f"/releases/{release.pk}/promote")
    assert promoted.status_code == 202, promoted.content
    try:
        wait_for_state(release, ("awaiting_approval", "failed", "gated"), cluster)
        detail = api(client, ci, "get", f"/releases/{release.pk}").json()
        if release.state == "gated":
            # On a loaded machine the load client may fall behind its schedule:
            # no evidence, inconclusive, never a pass. The operator takes load off
            # this environment's gates and promotes again: the gate runs again.
            # (A skipped "live" outcome holds nothing: nothing is live here yet.)
            open_gates = [
                g
                for g in detail["gate_results"]
                if g["outcome"] not in ("pass", "skipped")
            ]
            assert all(
                g["gate"].startswith("load:")
                and g["outcome"] == "inconclusive"
                and "fell behind" in g["reason"]
                for g in open_gates
            ), open_gates
            do_set_gate_policy(
                release.target_environment, {**POLICY, "load": None}, actor=owner
            )
            again = api(client, ci, "post", f"/releases/{release.pk}/promote")
            assert again.status_code == 202, again.content
            wait_for_state(release, ("awaiting_approval", "failed"), cluster, 60)
        first_gates = {g["gate"] for g in detail["gate_results"]}
        detail = api(client, ci, "get", f"/releases/{release.pk}").json()
        assert release.state == "awaiting_approval", (
            release.failure_reason,
            [g for g in detail["gate_results"] if g["outcome"] != "pass"],
        )
        outcomes = {(g["gate"], g["outcome"]) for g in detail["gate_results"]}
        # The environment's first release: "live" says it had nothing to compare
        # with (where load is gated), "routing" that the dense demo model routes
        # no experts, and every other gate passed.
        skippable = ("live", "routing")
        assert {outcome for gate, outcome in outcomes if gate not in skippable} == {
            "pass"
        }
        assert {outcome for gate, outcome in outcomes if gate in skippable} <= {
            "skipped"
        }
        assert ("routing", "skipped") in outcomes
        jobs = {job["kind"]: job for job in detail["jobs"]}
        assert set(jobs) == {
            "verify_source",
            "compress",
            "sign",
            "verify",
            "evaluate",
            "load_test",
            "gate",
        }
        assert jobs["sign"]["agent"] == "signer"
        assert jobs["verify"]["agent"] == "checker"
        gates = {g["gate"]: g["outcome"] for g in detail["gate_results"]}
        assert gates["integrity"] == "pass"
        assert any(g.startswith("quality:") for g in gates), gates
        assert any(g.startswith("load:") for g in first_gates), first_gates

        approve_to_live(release, detail, cluster, client, approver)
        deployment = release.deployments.get()
        # served under the release's own model name (the dashboard's), and pinned
        model = release.model.name
        answer = complete(deployment.endpoint, model)
        assert answer["model"] == model and answer["usage"]["completion_tokens"] >= 1
        pinned = complete(deployment.endpoint, f"{model}@{release.version}")
        assert pinned["model"] == model
        timings = api(client, ci, "get", f"/releases/{release.pk}").json()["timings"]
        assert timings["time_to_deploy_s"] > 0
        assert 0 < timings["integrity_pct"] < 100
        assert 0 < timings["quality_load_pct"] < 100
    finally:
        stop_servers(cluster)


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.django_db(transaction=True)
def test_it_retries_the_job_of_an_agent_killed_mid_job(cluster, demo_release, owner):
    release = demo_release
    # This is about the retry: the load gate's evidence (valid only where the
    # client kept its schedule) is judged in the test above.
    do_set_gate_policy(
        release.target_environment, {**POLICY, "load": None}, actor=owner
    )
    cluster.start_controlplane()
    cluster.start_agent("signer", signer=True)
    cluster.start_agent("checker", signer=False)
    cluster.wait_for_agents("signer", "checker")
    from controlplane.releases.actions.promotion import do_request_promotion

    do_request_promotion(release, owner)
    job = running_test_job(release, cluster)
    victim = job.agent.name
    killed_at = time.monotonic()
    cluster.kill(victim)

    # Noticed within the heartbeat timeout plus one watch interval (and slack for
    # a loaded machine), and sent again to the agent left.
    while True:
        job.refresh_from_db()
        if job.attempts >= 2:
            break
        assert time.monotonic() - killed_at < 3 * (AGENT_TIMEOUT_S + AGENT_CHECK_S), (
            cluster.log_tail()
        )
        time.sleep(0.2)
    noticed_s = time.monotonic() - killed_at
    assert noticed_s < 60
    assert Agent.objects.get(name=victim).state == "offline"
    wait_for_state(release, ("awaiting_approval", "failed", "gated"), cluster, 300)
    job.refresh_from_db()
    assert job.state == "succeeded", job.error
    assert job.agent.name != victim
    assert release.state == "awaiting_approval", release.failure_reason
    print(f"agent death noticed and job re-sent {noticed_s:.1f} s after kill -9")


def running_test_job(release, cluster):
    """An evaluate or load-test job of `release` running on some agent (waited
    for)."""
    deadline = time.monotonic() + 300
    while True:
        job = release.jobs.filter(
            kind__in=("evaluate", "load_test"), state="running", agent__isnull=False
        ).first()
        if job is not None:
            return job
        release.refresh_from_db()
        assert release.state not in ("failed", "failed_verification"), (
            release.failure_reason
        )
        assert time.monotonic() < deadline, cluster.log_tail()
        time.sleep(0.1)


# An agent killed and started again under its name gets its job again this soon;
# its silence alone would tell only after AGENT_DEAD_AFTER_S (here far longer).
RESTART_RESENT_S = 30


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.django_db(transaction=True)
def test_it_resends_the_job_of_an_agent_killed_and_restarted_under_its_name(
    cluster, demo_release, owner, settings
):
    release = demo_release
    do_set_gate_policy(
        release.target_environment, {**POLICY, "load": None}, actor=owner
    )
    cluster.dead_after_s = settings.AGENT_DEAD_AFTER_S = 10 * RESTART_RESENT_S
    cluster.allow_verify_on_signer = True  # one agent: it verifies what it signed
    cluster.start_controlplane()
    cluster.start_agent("solo", signer=True)
    cluster.wait_for_agents("solo")
    first = Agent.objects.get(name="solo")
    from controlplane.releases.actions.promotion import do_request_promotion

    do_request_promotion(release, owner)
    job = running_test_job(release, cluster)
    attempt = job.attempts
    killed_at = time.monotonic()
    cluster.kill("solo")
    cluster.start_agent("solo", signer=True)

    while True:
        job.refresh_from_db()
        if job.attempts > attempt:
            break
        assert time.monotonic() - killed_at < RESTART_RESENT_S, cluster.log_tail()
        time.sleep(0.2)
    resent_s = time.monotonic() - killed_at
    restarted = Agent.objects.get(name="solo")
    assert restarted.state == "online"  # never seen silent: the restart told
    assert restarted.incarnation not in ("", first.incarnation)
    assert restarted.started > first.started
    assert "agent solo restarted" in job.error
    wait_for_state(release, ("awaiting_approval", "failed", "gated"), cluster, 300)
    job.refresh_from_db()
    assert (job.state, job.agent.name) == ("succeeded", "solo"), job.error
    assert release.state == "awaiting_approval", release.failure_reason
    print(f"restart noticed and job re-sent {resent_s:.1f} s after kill -9")


def to_live(release, cluster, client, ci: str, approver: str) -> None:
    """Promote `release` through the API, approve it, wait until it is live."""
    promoted = api(client, ci, "post", f"/releases/{release.pk}/promote")
    assert promoted.status_code == 202, promoted.content
    wait_for_state(release, ("awaiting_approval", "failed", "gated"), cluster)
    detail = api(client, ci, "get", f"/releases/{release.pk}").json()
    assert release.state == "awaiting_approval", (
        release.failure_reason,
        [g for g in detail["gate_results"] if g["outcome"] != "pass"],
    )
    approve_to_live(release, detail, cluster, client, approver)


def approve_to_live(release, detail, cluster, client, approver: str) -> None:
    """Approve `release` (its `detail` from the API) and wait until it is live."""
    approved = api(
        client,
        approver,
        "post",
        f"/releases/{release.pk}/approve",
        {"manifest_digest": detail["manifest_digest"], "comment": "ok"},
    )
    assert approved.status_code == 200, approved.content
    wait_for_state(release, ("live", "failed", "failed_verification"), cluster)
    assert release.state == "live", release.failure_reason


# Re-verification of a tampered copy to a rollback that answers again, on a loaded
# 2-core machine: the jobs are hashing a 3.2M-parameter model and a /health check.
TAMPER_TO_ROLLED_BACK_S = 120


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_a_tampered_live_copy_is_quarantined_and_rolled_back(
    cluster, demo_release, make_release, make_source, client, owner, teammate
):
    """Two releases go live in turn; a byte of the live one's deployed copy is
    flipped; the re-verification job fails it and quarantines its digest (on the
    agent too); a rollback through the API goes to the previous release, whose
    server still verifies and answers, and which answers a completion."""
    first = demo_release
    environment = first.target_environment
    # The load gate needs a quiet machine: off here (this is about integrity).
    do_set_gate_policy(environment, {**POLICY, "load": None}, actor=owner)
    source = make_source("demo-readme")
    source.rmdir()
    shutil.copytree(DEMO_MODEL, source)
    (source / "README.md").write_text("the demo model, second release\n")
    second = make_release(source_uri=source.as_uri(), recipe=RECIPE)
    cluster.start_controlplane()
    cluster.start_agent("signer", signer=True)
    cluster.start_agent("checker", signer=False)
    cluster.wait_for_agents("signer", "checker")
    _, ci = ApiToken.create(owner, first.team, "ci", ["read", "promote"])
    _, approver = ApiToken.create(
        teammate, first.team, "ap", ["read", "approve", "promote"]
    )
    registry = Registry(cluster.artifacts / "serving")
    try:
        to_live(first, cluster, client, ci, approver)
        to_live(second, cluster, client, ci, approver)
        first.refresh_from_db()
        assert first.state == "superseded"  # kept loaded: the rollback target
        live = second.deployments.get(state="live")
        digest = live.release.manifest_digest
        (copy,) = [
            d
            for d in loaded_deployments(registry)
            if d.deployment_id == live.serving_id
        ]
        weights = Path(copy.model_dir) / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x01  # one bit of one weight of the live copy
        weights.write_bytes(bytes(data))
        tampered_at = time.monotonic()

        celery_app.send_task(
            "controlplane.releases.run_reverification",
            args=[live.pk],
            queue=cluster.queue,
        )
        wait_for_state(second, ("failed_verification",), cluster, 120)
        live.refresh_from_db()
        assert live.state == "failed_verification"
        job = second.jobs.get(kind="reverify")
        assert job.result["changed"] == ["model.safetensors"], job.error
        assert digest in registry.quarantined()  # the agent loads it never again

        rollback = api(
            client, approver, "post", f"/environments/{environment.pk}/rollback"
        )
        assert rollback.status_code == 202, rollback.content
        wait_for_state(first, ("live", "failed", "failed_verification"), cluster, 120)
        rolled_back_s = time.monotonic() - tampered_at
        assert first.state == "live", first.failure_reason
        second.refresh_from_db()
        assert second.state == "quarantined"
        endpoint = first.deployments.get(state="live").endpoint
        assert httpx.get(f"{endpoint}/health", timeout=10).status_code == 200
        answer = complete(endpoint, f"{first.model.name}@{first.version}")
        assert answer["usage"]["completion_tokens"] >= 1
        assert rolled_back_s < TAMPER_TO_ROLLED_BACK_S, rolled_back_s
        # The tampered server, superseded beyond the rollback target, is stopped.
        deadline = time.monotonic() + 60
        while any(d.manifest_digest == digest for d in loaded_deployments(registry)):
            assert time.monotonic() < deadline, cluster.log_tail()
            time.sleep(0.5)
        print(f"tamper -> re-verified -> rolled back and live in {rolled_back_s:.1f} s")
    finally:
        stop_servers(cluster)
