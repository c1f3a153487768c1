"""The agent's job handlers (gpuagent.tasks) in-process on the demo model: real
inspection, bf16 compression, signatures, verification on an agent holding only
the public key, and the refusals (tampered bytes, unsupported formats)."""

import json
import shutil
from pathlib import Path

import httpx
import pytest

import gpuagent.engine
from gpuagent import tasks
from gpuagent.artifacts import ArtifactStore
from gpuagent.engine.arch import MoETransformer
from gpuagent.engine.loader import load_model
from gpuagent.integrity.keys import ensure_key_pair
from gpuagent.protocol import (
    BackendSpec,
    CompressJobResult,
    ConcurrencySweep,
    JobRequest,
    Lengths,
    LoadPlan,
    LoadTestReport,
    QualityReport,
    Recipe,
    Sweeps,
    WorkloadPlan,
)
from gpuagent.serving import loaded_deployments

DEMO = Path(gpuagent.engine.__file__).parent / "demo_model"
MOE_DEMO = Path(gpuagent.engine.__file__).parent / "moe_demo_model"


def make_agent(name, store, *, signing_key=None, trusted=()):
    return tasks.Agent(
        name=name,
        store=store,
        signing_key=signing_key,
        trusted_keys=tuple(trusted),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
    )


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "report_progress", lambda *a: None)
    source = tmp_path / "src"
    shutil.copytree(DEMO, source)
    store = ArtifactStore(tmp_path / "artifacts")
    key = tmp_path / "keys" / "signer.pem"
    public = ensure_key_pair(key)
    signer = make_agent("signer", store, signing_key=key)
    checker = make_agent("checker", store, trusted=[public])
    return source, signer, checker


def request(kind, source, job_id=1, **fields):
    return JobRequest(
        job_id=job_id,
        release_id=7,
        kind=kind,
        source_uri=source.as_uri(),
        recipe=Recipe(weights="bf16", kv_cache_dtype="int8"),
        model="demo",
        version="1.0",
        **fields,
    )


def signed_candidate(source, signer):
    made = tasks.compress(request("compress", source), signer)
    signed = tasks.sign(request("sign", source, candidate=made.candidate), signer)
    return made, signed


def test_it_makes_signs_and_verifies_a_bf16_candidate_on_another_agent(setup):
    source, signer, checker = setup
    inspected = tasks.inspect_source(request("verify_source", source), signer)

    made, signed = signed_candidate(source, signer)
    verified = tasks.verify(
        request(
            "verify",
            source,
            candidate=made.candidate,
            signature=signed.signature,
            manifest_digest=signed.manifest_digest,
        ),
        checker,
    )

    assert inspected.ok and inspected.manifest_digest == made.source_manifest_digest
    assert made.size_bytes < 0.6 * made.source_size_bytes  # f32 -> bf16 halves it
    assert verified.ok and verified.manifest_digest == signed.manifest_digest
    assert verified.signer and signed.signer


def test_it_makes_signs_and_verifies_a_candidate_of_the_sharded_moe_demo(
    setup, tmp_path
):
    _, signer, checker = setup
    source = tmp_path / "moe-src"
    shutil.copytree(MOE_DEMO, source)
    inspected = tasks.inspect_source(request("verify_source", source), signer)

    made, signed = signed_candidate(source, signer)
    verified = tasks.verify(
        request(
            "verify",
            source,
            candidate=made.candidate,
            signature=signed.signature,
            manifest_digest=signed.manifest_digest,
        ),
        checker,
    )

    assert inspected.ok and inspected.manifest_digest == made.source_manifest_digest
    assert verified.ok and verified.manifest_digest == signed.manifest_digest
    candidate = signer.store.path_of(made.candidate)
    model = load_model(candidate)
    assert isinstance(model, MoETransformer)
    assert json.loads((candidate / "config.json").read_text())["model_type"] == (
        "deepseek_v3"
    )


def test_it_finds_a_redelivered_jobs_output(setup):
    source, signer, _ = setup
    req = request("compress", source)
    first = tasks.execute(req, signer, started=None)
    again = tasks.execute(req.model_copy(update={"attempt": 2}), signer, started=None)

    assert first.ok and again.payload == first.payload


def test_it_compresses_to_the_recipes_weight_format(setup):
    source, signer, _ = setup
    req = request("compress", source).model_copy(
        update={"recipe": Recipe(weights="w4a16-g128", kv_cache_dtype="int8")}
    )

    result = tasks.execute(req, signer, started=None)

    assert result.ok, result.error
    made = CompressJobResult.model_validate(result.payload)
    config = json.loads(
        (signer.store.path_of(made.candidate) / "config.json").read_text()
    )
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert made.report.quantized_layers > 0 and made.report.out_dir == made.candidate
    assert made.size_bytes < 0.5 * made.source_size_bytes


def test_a_second_job_with_the_same_source_and_recipe_reuses_the_candidate(setup):
    source, signer, _ = setup
    first = tasks.execute(request("compress", source), signer, started=None)
    other = request("compress", source).model_copy(update={"job_id": 999})

    again = tasks.execute(other, signer, started=None)

    assert again.ok and again.payload == first.payload


def test_it_refuses_a_recipe_the_compressor_cannot_apply(setup):
    source, signer, _ = setup
    req = request("compress", source).model_copy(
        update={
            "recipe": Recipe(weights="int8", kv_cache_dtype="int8", symmetric=False)
        }
    )

    result = tasks.execute(req, signer, started=None)

    assert not result.ok
    assert "symmetric=false is only offered for int4" in result.error
    assert not list((signer.store.root / "candidates").iterdir())


def test_it_refuses_to_sign_without_a_key(setup):
    source, signer, checker = setup
    made = tasks.compress(request("compress", source), signer)

    result = tasks.execute(
        request("sign", source, candidate=made.candidate), checker, started=None
    )

    assert not result.ok and "holds no signing key" in result.error


def test_it_refuses_to_deploy_tampered_bytes(setup):
    source, signer, checker = setup
    made, signed = signed_candidate(source, signer)
    weights = checker.store.path_of(made.candidate) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight, after the approval
    weights.write_bytes(bytes(data))

    result = tasks.execute(
        request(
            "deploy",
            source,
            candidate=made.candidate,
            signature=signed.signature,
            manifest_digest=signed.manifest_digest,
            deployment_id=3,
        ),
        checker,
        started=None,
    )

    assert not result.ok
    assert result.payload["changed"] == ["model.safetensors"], result.error
    assert loaded_deployments(checker.registry) == []  # nothing was started


def deploy_fields(source, signer):
    """A candidate made and signed by `signer`: (the compress result, the deploy
    request fields naming it)."""
    made, signed = signed_candidate(source, signer)
    return made, dict(
        candidate=made.candidate,
        signature=signed.signature,
        manifest_digest=signed.manifest_digest,
        deployment_id=3,
    )


def deploy_signed(source, signer, checker):
    """A candidate made and signed by `signer`, deployed on `checker`: (the
    compress result, the request fields naming it, the deploy JobResult)."""
    made, fields = deploy_fields(source, signer)
    deployed = tasks.execute(request("deploy", source, **fields), checker, None)
    assert deployed.ok, deployed.error
    return made, fields, deployed


def test_it_deploys_reverifies_and_undeploys_through_the_serving_registry(setup):
    source, signer, checker = setup
    made, fields, deployed = deploy_signed(source, signer, checker)
    serving_id = deployed.payload["deployment_id"]
    endpoint = deployed.payload["endpoint"]
    try:
        assert httpx.get(endpoint + "/health").status_code == 200
        models = httpx.get(endpoint + "/v1/models").json()["data"]
        # the release's own model name, then model@version
        assert [m["id"] for m in models] == ["demo", "demo@1.0"]
        assert [d.deployment_id for d in loaded_deployments(checker.registry)] == [
            serving_id
        ]
        again = tasks.execute(
            request("deploy", source, job_id=2, **fields), checker, None
        )
        assert again.payload["deployment_id"] == serving_id  # redelivered: same server
        check = request("reverify", source, job_id=3, serving_id=serving_id, **fields)
        assert tasks.execute(check, checker, None).ok
    finally:
        stop = request("undeploy", source, job_id=4, serving_id=serving_id, **fields)
        stopped = tasks.execute(stop, checker, None)
    assert stopped.ok and stopped.payload["stopped"] is True
    assert loaded_deployments(checker.registry) == []


def test_it_reverifies_a_deployed_copy_names_what_changed_and_quarantines(setup):
    source, signer, checker = setup
    made, fields, deployed = deploy_signed(source, signer, checker)
    serving_id = deployed.payload["deployment_id"]
    req = request("reverify", source, job_id=2, serving_id=serving_id, **fields)
    try:
        assert tasks.execute(req, checker, started=None).ok
        folder = checker.store.path_of(made.candidate)
        (folder / "tokenizer_config.json").unlink()
        (folder / "extra.json").write_text("{}")

        result = tasks.execute(req, checker, started=None)
    finally:
        tasks.serving.undeploy(serving_id, registry=checker.registry)

    assert not result.ok
    assert result.payload["missing"] == ["tokenizer_config.json"]
    assert result.payload["extra"] == ["extra.json"]
    assert fields["manifest_digest"] in checker.registry.quarantined()
    refused = tasks.execute(
        request("deploy", source, job_id=5, **fields), checker, None
    )
    assert not refused.ok and refused.payload["error_code"] == "quarantined"


def test_it_refuses_a_digest_the_control_plane_quarantined_it_never_saw(setup):
    source, signer, checker = setup
    _, fields = deploy_fields(source, signer)
    assert checker.registry.quarantined() == []  # this agent saw no incident

    refused = tasks.execute(
        request(
            "deploy", source, quarantined_digests=[fields["manifest_digest"]], **fields
        ),
        checker,
        None,
    )

    assert not refused.ok and refused.payload["error_code"] == "quarantined"
    assert "quarantined" in refused.error
    assert loaded_deployments(checker.registry) == []  # nothing was started


@pytest.mark.parametrize(
    ("backend", "seconds"),
    [
        (BackendSpec(), tasks.HEALTH_TIMEOUT_S),  # our engine starts in seconds
        # an external engine's cold start: spawn, weights, compile, graph capture
        (BackendSpec(kind="external", preset="vllm"), 1800.0),
        (BackendSpec(kind="external", preset="vllm", health_timeout_s=5400), 5400.0),
        (BackendSpec(health_timeout_s=30), 30.0),
    ],
)
def test_the_health_wait_is_the_environments_or_its_kinds_default(
    setup, backend, seconds
):
    source, signer, _ = setup

    req = request("deploy", source, manifest_digest="sha256:" + "0" * 64)

    spec = tasks.deploy_spec(req, signer, backend)

    assert spec.health_timeout_s == seconds


def test_an_fp8_kv_candidate_is_compressed_in_the_target_environments_layout(setup):
    source, signer, _ = setup
    fp8_kv = Recipe(weights="bf16", kv_cache_dtype="fp8")
    made = {}
    for strategy in ("tensor", "attn_head"):
        req = request("compress", source).model_copy(
            update={
                "recipe": fp8_kv,
                "backend": BackendSpec(kv_scale_strategy=strategy),
            }
        )
        made[strategy] = CompressJobResult.model_validate(
            tasks.execute(req, signer, started=None).payload
        )

    # two candidates (a per-head one is never reused for a per-tensor target)
    assert made["tensor"].candidate != made["attn_head"].candidate
    for strategy, result in made.items():
        config = json.loads(
            (signer.store.path_of(result.candidate) / "config.json").read_text()
        )
        kv = config["quantization_config"]["kv_cache_scheme"]
        assert kv["strategy"] == result.report.kv_scale_strategy == strategy


# The project's engine, small, as an environment that takes the gate's evidence
# from its serving backend sets it.
EVIDENCE_BACKEND = BackendSpec(
    kv_memory_gb=0.005,
    max_num_seqs=2,
    threads=1,
    device="cpu",
    gate_evidence="serving_backend",
)


@pytest.mark.timeout(300)
def test_it_evaluates_on_the_serving_backend_and_stops_its_servers(setup, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the children's torch refs
    source, signer, checker = setup
    _made, fields = deploy_fields(source, signer)
    fields.pop("deployment_id")
    req = request("evaluate", source, backend=EVIDENCE_BACKEND, **fields)

    result = tasks.execute(req, checker, None)

    assert result.ok, result.error
    report = QualityReport.model_validate(result.payload)
    assert report.method == "http_top_n" and report.servers == "side_by_side"
    candidate, parent = report.candidate_engine, report.reference_engine
    assert candidate.name == parent.name == "releasegate"
    assert candidate.backend == "engine"
    assert candidate.command[candidate.command.index("--kv-cache-dtype") + 1] == "int8"
    assert parent.command[parent.command.index("--kv-cache-dtype") + 1] == "bf16"
    assert "--signature" in candidate.command  # verified on load, signature and all
    overall = report.slices[-1]
    assert overall.name == "overall" and overall.num_tokens > 0
    assert overall.tail_mass_mean is not None
    assert loaded_deployments(checker.registry) == []


def test_a_server_that_does_not_start_fails_the_evaluation_by_name(setup):
    source, signer, checker = setup
    _made, fields = deploy_fields(source, signer)
    fields.pop("deployment_id")
    stale = fields | {"manifest_digest": "sha256:" + "0" * 64}
    req = request("evaluate", source, backend=EVIDENCE_BACKEND, **stale)

    result = tasks.execute(req, checker, None)

    assert not result.ok
    assert result.error.startswith("evaluate: no server for demo")
    assert loaded_deployments(checker.registry) == []


@pytest.mark.timeout(300)
def test_it_load_tests_on_the_serving_backend_and_names_the_engine(setup, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    source, signer, checker = setup
    _made, fields = deploy_fields(source, signer)
    fields.pop("deployment_id")
    chat = WorkloadPlan(
        name="chat",
        task="chat",
        language="en",
        prompt=Lengths(tokens=128),
        output=Lengths(tokens=4),
    )
    plan = LoadPlan(
        workloads=[chat],
        sweeps=Sweeps(
            concurrency=ConcurrencySweep(levels=[1], mode="stepped"), context=None
        ),
        budget_s=30,
    )
    backend = EVIDENCE_BACKEND.model_copy(update={"kv_memory_gb": 0.02})
    req = request("load_test", source, backend=backend, load_plan=plan, **fields)

    result = tasks.execute(req, checker, None)

    assert result.ok, result.error
    report = LoadTestReport.model_validate(result.payload)
    assert report.engine.name == "releasegate" and report.engine.backend == "engine"
    assert "--kv-memory-gb" in report.engine.command
    memory = report.engine.command[report.engine.command.index("--kv-memory-gb") + 1]
    assert float(memory) == 0.02  # the environment's backend, not the default
    assert report.workloads, (report.unmeasured, report.skipped_for_budget)
    assert report.workloads[0].runs[0].num_requests > 0
    assert loaded_deployments(checker.registry) == []
