"""The agent's Celery task and one handler per job kind.

The control plane sends `gpuagent.run_job(JobRequest)` to an agent's own queue or
its pool's queue; the task runs the kind's handler, which returns the kind's result
model, and sends the `JobResult` back to the control plane's queue by task name
(`controlplane.releases.record_job_result`), with progress reports on the way
(`controlplane.releases.record_job_progress`). Agents never touch the database.
A request must carry a seal (gpuagent.integrity.identity) made by the control
plane's key and be fresh (GPUAGENT_JOB_MAX_AGE_S): anything else is refused,
logged, and not answered. Results and progress reports leave sealed with this
agent's key.

Handlers call the real packages: gpuagent.integrity (inspect, hash, sign, verify),
gpuagent.evaluate (in-process quality regression of candidate vs parent),
gpuagent.loadtest (against a server gpuagent.serving starts for the candidate)
and gpuagent.serving (deploy: verify, then serve; undeploy; re-verify a deployed
copy), whose Registry (`<artifacts>/serving`) is this agent's record of what it
serves. A handler that can't do what the request asks raises JobFailed (with a
payload where it has one): never a success that did no work.

Who this agent is (`Agent`, `agent()`), its heartbeat and what starts it when its
worker is ready live in gpuagent.worker, which this module imports (and which
imports nothing of it): importing the tasks also connects that start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

from celery import shared_task
from pydantic import BaseModel

from gpuagent import serving
from gpuagent.artifacts import candidate_key
from gpuagent.integrity import identity
from gpuagent.integrity.keys import public_key_pem
from gpuagent.protocol import (
    BackendSpec,
    CompressJobResult,
    CompressResult,
    DeployResult,
    DeploySpec,
    HashResult,
    InspectResult,
    JobRequest,
    JobResult,
    Seal,
    UndeployResult,
    VerifyResult,
    default_load_plan,
)
from gpuagent.serving import Trust
from gpuagent.worker import Agent, agent, send_to_controlplane

log = logging.getLogger(__name__)

RECORD_RESULT = "controlplane.releases.record_job_result"
RECORD_PROGRESS = "controlplane.releases.record_job_progress"
# Small, bounded settings: the gate's evidence on the agent's own hardware in
# seconds for the demo model (a GPU agent runs the same code, faster).
EVAL_ITEMS_PER_SLICE = 2
# How long an agent's server may take to answer /health when the environment's
# backend sets no health_timeout_s: the project's engine loads in seconds; an
# external engine's cold start (worker spawn, tens of GB of weights, compile, CUDA
# graph capture) can take many minutes. And the engine's KV budget when the
# environment's backend sets none. (A server answers to the release's model name and
# `model@version`: gpuagent.serving.deploy.served_model_names.)
HEALTH_TIMEOUT_S = 120.0
EXTERNAL_HEALTH_TIMEOUT_S = 1800.0
ENGINE_KV_MEMORY_GB = 0.05


class JobFailed(Exception):
    """The job ran and the answer is no (a rejected source, a mismatch, a format
    this agent can't make); `payload` says what it found."""

    def __init__(self, message: str, payload: BaseModel | None = None):
        super().__init__(message)
        self.payload = payload


# -- the task ------------------------------------------------------------------------


class JobRefused(Exception):
    """A job request this agent does not run: unsigned, forged, stale or
    malformed."""


def accept_job(request: dict, seal: dict | None, me: Agent) -> JobRequest:
    """The JobRequest of `request` if the control plane sealed it, recently, for
    this very job; JobRefused naming why otherwise."""
    if not me.controlplane_keys:
        raise JobRefused("this agent trusts no control-plane key")
    if seal is None:
        raise JobRefused("unsigned job request")
    try:
        sealed = Seal.model_validate(seal)
        req = JobRequest.model_validate(request)
    except ValueError as exc:
        raise JobRefused(f"malformed job request: {exc}") from exc
    keys = [k for k in me.controlplane_keys if identity.fingerprint(k) == sealed.signer]
    if not keys:
        raise JobRefused(f"job request sealed by an unknown key {sealed.signer[:16]}")
    try:
        identity.check_seal(
            sealed,
            keys[0],
            request,
            max_skew_s=me.job_max_age_s,
            type="job",
            job_id=req.job_id,
            attempt=req.attempt,
            kind=req.kind,
            release_id=req.release_id,
        )
    except identity.SealRefused as exc:
        raise JobRefused(f"job request refused: {exc}") from exc
    return req


def sealed_result(result: JobResult, req: JobRequest, me: Agent) -> tuple:
    """The arguments of the control plane's record_job_result for `result`."""
    body = result.model_dump(mode="json")
    sealed = identity.seal(
        me.identity,
        body,
        type="result",
        job_id=req.job_id,
        attempt=req.attempt,
        kind=req.kind,
        release_id=req.release_id,
    )
    return body, req.attempt, sealed.model_dump(mode="json")


def sealed_progress(req: JobRequest, fraction: float, me: Agent) -> tuple:
    """The arguments of the control plane's record_job_progress."""
    body = {
        "job_id": req.job_id,
        "attempt": req.attempt,
        "agent": me.name,
        "progress": fraction,
    }
    sealed = identity.seal(
        me.identity,
        body,
        type="progress",
        job_id=req.job_id,
        attempt=req.attempt,
        kind=req.kind,
        release_id=req.release_id,
    )
    return req.job_id, req.attempt, me.name, fraction, sealed.model_dump(mode="json")


@shared_task(name="gpuagent.run_job", acks_late=True)
def run_job(request: dict, seal: dict | None = None) -> dict:
    """Run one job and send its JobResult to the control plane; returns it. A
    request the control plane did not seal is refused (logged, not answered)."""
    me = agent()
    started = datetime.now(UTC)
    try:
        req = accept_job(request, seal, me)
    except JobRefused as exc:
        job_id = request.get("job_id") if isinstance(request, dict) else None
        log.error("refused a job request (job %s): %s", job_id, exc)
        return {"refused": str(exc)}
    with me.lock:
        me.running_jobs.add(req.job_id)
    try:
        report_progress(req, 0.0)
        result = execute(req, me, started)
    finally:
        with me.lock:
            me.running_jobs.discard(req.job_id)
    send_to_controlplane(RECORD_RESULT, *sealed_result(result, req, me))
    return result.model_dump(mode="json")


def execute(req: JobRequest, me: Agent, started: datetime) -> JobResult:
    """The JobResult of `req`: a stored output of an earlier delivery, or the
    handler's. A crash is a failed result naming it, never a lost job."""
    ok, error, payload = True, "", me.store.stored_output(req)
    if payload is None:
        try:
            model = HANDLERS[req.kind](req, me)
            payload = model.model_dump(mode="json")
            me.store.store_output(req, payload)
        except JobFailed as exc:
            ok, error = False, str(exc)
            payload = exc.payload.model_dump(mode="json") if exc.payload else {}
        except Exception as exc:  # a bug or an unreadable file: the job failed
            log.exception("%s job %s crashed", req.kind, req.job_id)
            ok, error, payload = False, f"{type(exc).__name__}: {exc}", {}
    return JobResult(
        job_id=req.job_id,
        kind=req.kind,
        ok=ok,
        agent=me.name,
        started=started,
        finished=datetime.now(UTC),
        error=error,
        payload=payload,
    )


def report_progress(req: JobRequest, fraction: float) -> None:
    """Tell the control plane how far the job is (also: which agent runs it)."""
    try:
        send_to_controlplane(RECORD_PROGRESS, *sealed_progress(req, fraction, agent()))
    except Exception:  # progress is advisory: a lost report never fails the job
        log.warning("progress report of job %s not sent", req.job_id, exc_info=True)


# -- handlers ------------------------------------------------------------------------


def source_folder(source_uri: str) -> Path:
    """The local folder a file:// URI or absolute path names."""
    parts = urlsplit(source_uri)
    if parts.scheme not in ("", "file"):
        raise JobFailed(f"this agent reads local sources only, not {parts.scheme}://")
    folder = Path(unquote(parts.path) if parts.scheme else source_uri)
    if not folder.is_dir():
        raise JobFailed(f"source folder {folder} does not exist")
    return folder


def hashed(folder: Path):
    """(manifest, [FileDigest]) of a folder, through gpuagent.integrity."""
    from gpuagent.integrity import file_digests, hash_model

    manifest = hash_model(folder)
    return manifest, file_digests(folder, manifest)


def inspect_source(req: JobRequest, me: Agent) -> InspectResult:
    """Structure and content checks of the source (no pickles, no code, valid
    safetensors), then its manifest digest: the candidate's parent."""
    from gpuagent.integrity import IntegrityError, inspect_model

    folder = source_folder(req.source_uri)
    try:
        inspect_model(folder)
    except IntegrityError as exc:
        report = getattr(exc, "report", None)
        problems = [
            f"{f.path}: {finding.code}: {finding.detail}"
            for f in (report.files if report else [])
            for finding in f.findings
        ]
        raise JobFailed(str(exc), InspectResult(ok=False, problems=problems)) from exc
    manifest, files = hashed(folder)
    return InspectResult(ok=True, files=files, manifest_digest=manifest.digest)


def compress(req: JobRequest, me: Agent) -> CompressJobResult:
    """Make the candidate under the recipe with gpuagent.compress (bf16 / fp16 casts,
    w8a16, w4a16-gN, fp8; RTN or GPTQ); a recipe it can't apply or a source it
    refuses fails the job with its reason. Content-addressed: a redelivered job
    finds the candidate made before."""
    from gpuagent.compress import CompressError, RecipeError
    from gpuagent.compress import compress as compress_model

    assert req.recipe is not None, "compress needs a recipe"
    folder = source_folder(req.source_uri)
    manifest, files = hashed(folder)
    report_progress(req, 0.05)
    # fp8 KV scales in the layout the target environment's engine reads.
    kv_strategy = req.backend.kv_scale_strategy
    key = candidate_key(manifest.digest, req.recipe, kv_strategy)
    # The report lives beside the candidate, so a later job with the same source and
    # recipe (another release, a reopened one) gets it with the candidate.
    report_path = me.store.root / "candidates" / f"{key}.compress.json"

    def build(tmp: Path) -> None:
        def progress(done: int, total: int, _what: str) -> None:
            report_progress(req, 0.05 + 0.9 * done / max(total, 1))

        try:
            made = compress_model(
                folder,
                req.recipe,
                tmp,
                progress=progress,
                kv_scale_strategy=kv_strategy,
                sequential=not _is_moe_source(folder),
            )
        except (CompressError, RecipeError) as exc:
            raise JobFailed(f"compress: {exc}") from exc
        # Written before the candidate is renamed into place, so a candidate never
        # exists without its report.
        part = report_path.with_suffix(f".{os.getpid()}.tmp")
        part.write_text(made.model_dump_json())
        os.replace(part, report_path)

    candidate = me.store.candidate(key, build)
    name = me.store.relative(candidate)
    try:
        report = CompressResult.model_validate_json(report_path.read_text())
    except (OSError, ValueError) as exc:
        raise JobFailed(f"candidate {name} has no readable compress report") from exc
    return CompressJobResult(
        candidate=name,
        weights=req.recipe.weights,
        kv_cache_dtype=req.recipe.kv_cache_dtype,
        source_manifest_digest=manifest.digest,
        size_bytes=sum(p.stat().st_size for p in candidate.iterdir()),
        source_size_bytes=sum(f.size_bytes for f in files),
        report=report.model_copy(update={"out_dir": name}),
    )


def _is_moe_source(folder: Path) -> bool:
    """Whether the source's config.json names a MoE architecture (DeepSeek-V3,
    Kimi K2, GLM-4.5). The layer-by-layer compress path builds Llama layers only
    (a MoE source fails there with missing q/k/v tensors), so these go through the
    in-memory path, which builds the model the loader builds. An unreadable config
    is left to `compress` to refuse."""
    from gpuagent.engine.arch import MOE_MODEL_TYPES

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in MOE_MODEL_TYPES


def _candidate(req: JobRequest, me: Agent) -> Path:
    if not req.candidate:
        raise JobFailed(f"{req.kind} needs a candidate; none was made")
    folder = me.store.path_of(req.candidate)
    if not folder.is_dir():
        raise JobFailed(f"candidate {req.candidate} is not in this agent's store")
    return folder


def recipe_text(req: JobRequest) -> str:
    assert req.recipe is not None
    return f"weights={req.recipe.weights},kv={req.recipe.kv_cache_dtype}"


def _binding(req: JobRequest):
    from gpuagent.integrity import ReleaseBinding

    return ReleaseBinding(model=req.model, version=req.version, recipe=recipe_text(req))


def sign(req: JobRequest, me: Agent) -> HashResult:
    """Hash the candidate and sign its manifest bound to model, version, recipe."""
    from gpuagent.integrity import file_digests, key_fingerprint, sign_model

    if me.signing_key is None:
        raise JobFailed(f"agent {me.name} holds no signing key; it cannot sign")
    folder = _candidate(req, me)
    signature = me.store.root / "signatures" / f"release-{req.release_id}.sig"
    signed = sign_model(
        folder, signature, release=_binding(req), private_key=me.signing_key
    )
    # the file list of the very manifest signed (sign_model hashed the folder)
    files = file_digests(folder, signed.manifest)
    return HashResult(
        manifest_digest=signed.manifest.digest,
        files=files,
        signature=signature.read_text(),
        signer=key_fingerprint(public_key_pem(me.signing_key)),
    )


def verify_candidate(folder: Path, req: JobRequest, me: Agent) -> VerifyResult:
    """Verify `folder` against the request's signature (trusted keys, release
    binding, every file re-hashed) and approved manifest digest; JobFailed naming
    the missing, extra and changed files otherwise."""
    from gpuagent.integrity import IntegrityError, ManifestMismatchError, verify_model
    from gpuagent.integrity.policy import Policy

    signed = trust(req, me)
    policy = Policy(
        public_keys_pem=tuple(k.read_bytes() for k in signed.public_keys),
        release=_binding(req),
    )
    try:
        report = verify_model(folder, signed.signature_path, policy)
    except ManifestMismatchError as exc:
        raise JobFailed(
            str(exc),
            VerifyResult(
                ok=False,
                manifest_digest="",
                missing=exc.missing,
                extra=exc.extra,
                changed=exc.changed,
            ),
        ) from exc
    except IntegrityError as exc:
        raise JobFailed(str(exc)) from exc
    if req.manifest_digest and report.manifest_digest != req.manifest_digest:
        raise JobFailed(
            f"signed manifest {report.manifest_digest} is not the approved "
            f"{req.manifest_digest}",
            VerifyResult(ok=False, manifest_digest=report.manifest_digest),
        )
    return VerifyResult(
        ok=True, manifest_digest=report.manifest_digest, signer=report.signer
    )


def verify(req: JobRequest, me: Agent) -> VerifyResult:
    return verify_candidate(_candidate(req, me), req, me)


def evaluate(req: JobRequest, me: Agent):
    """QualityReport of the candidate (recipe's KV dtype) vs the source (bf16 KV),
    in-process, on a bounded slice of the shipped eval sets."""
    import torch

    from gpuagent.evaluate import EngineModel, Settings, evaluate_quality

    torch.set_num_threads(me.threads)
    candidate = EngineModel(_candidate(req, me), req.recipe.kv_cache_dtype, 512)
    report_progress(req, 0.1)
    reference = EngineModel(source_folder(req.source_uri), "bf16", 512)
    settings = Settings(
        seed=req.release_id,
        continuation_tokens=4,
        passage_tokens=96,
        long_context_tokens=480,
        max_items=EVAL_ITEMS_PER_SLICE,
    )
    report = evaluate_quality(candidate, reference, settings)
    # The labels hold host paths: name the sides by what they are instead.
    return report.model_copy(
        update={
            "candidate": f"candidate ({recipe_text(req)})",
            "reference": "source (kv bf16)",
        }
    )


def load_test(req: JobRequest, me: Agent):
    """LoadTestReport of an engine server started for the candidate (through
    gpuagent.serving, verified against its digest first) with the recipe's KV
    dtype, under the request's load plan (the environment's; the default plan
    when it sends none), stopped at the plan's budget. The report carries the
    plan that ran."""
    from gpuagent.loadtest.plan_runner import run_plan

    plan = req.load_plan or default_load_plan()
    before = {info.deployment_id for info in serving.loaded_deployments(me.registry)}
    spec = deploy_spec(req, me, BackendSpec())
    server = serving.deploy(_candidate(req, me), spec, registry=me.registry)
    if not server.ok:
        raise JobFailed(f"load test: no server for the candidate: {server.error}")
    report_progress(req, 0.2)
    try:
        return asyncio.run(
            run_plan(
                server.endpoint,
                plan,
                model=spec.served_model_name or None,
            )
        )
    finally:
        if server.deployment_id not in before:  # never stop a live deployment
            serving.undeploy(server.deployment_id, registry=me.registry)


def health_timeout_s(backend: BackendSpec) -> float:
    """The environment's health_timeout_s, else the default of its backend's kind."""
    if backend.health_timeout_s is not None:
        return backend.health_timeout_s
    return HEALTH_TIMEOUT_S if backend.kind == "engine" else EXTERNAL_HEALTH_TIMEOUT_S


def deploy_spec(req: JobRequest, me: Agent, backend: BackendSpec) -> DeploySpec:
    """The DeploySpec of `req`: its approved digest, recipe and release binding, on
    `backend` (the environment's; the project's engine gets this agent's threads
    and a small KV budget when the environment sets none)."""
    assert req.recipe is not None, f"{req.kind} needs a recipe"
    if backend.kind == "engine":
        backend = backend.model_copy(
            update={
                "threads": backend.threads or me.threads,
                "kv_memory_gb": backend.kv_memory_gb or ENGINE_KV_MEMORY_GB,
            }
        )
    return DeploySpec(
        manifest_digest=req.manifest_digest,
        recipe=req.recipe,
        backend=backend,
        served_model_name=req.model,
        health_timeout_s=health_timeout_s(backend),
        release_model=req.model,
        release_version=req.version,
        release_recipe=recipe_text(req),
        quarantined_digests=req.quarantined_digests,
    )


def trust(req: JobRequest, me: Agent) -> Trust:
    """The request's signature (written where this agent keeps signatures) and
    the keys this agent trusts."""
    if not req.signature:
        raise JobFailed(f"{req.kind} needs the candidate's signature; none recorded")
    keys = me.public_keys()
    if not keys:
        raise JobFailed(f"agent {me.name} trusts no signing key")
    folder = me.store.root / "signatures"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"job-{req.job_id}.sig"
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False) as tmp:
        tmp.write(req.signature)
    os.replace(tmp.name, path)
    return Trust(signature_path=path, public_keys=keys)


def deploy(req: JobRequest, me: Agent) -> DeployResult:
    """gpuagent.serving.deploy of the candidate on the environment's backend: the
    folder is verified against the approved digest and signature before any
    process starts, the server (the engine verifies on load again) must answer
    /health. A redelivered deploy finds its server still healthy and returns it."""
    spec = deploy_spec(req, me, req.backend)
    result = serving.deploy(
        _candidate(req, me),
        spec,
        registry=me.registry,
        trust=trust(req, me),
        allowed_programs=me.allowed_programs,
    )
    if not result.ok:
        raise JobFailed(result.error, result)
    return result


def undeploy(req: JobRequest, me: Agent) -> UndeployResult:
    """Stop the deployment's server (idempotent: stopped=False when none ran)."""
    if not req.serving_id:
        raise JobFailed("undeploy needs the agent's deployment id; none recorded")
    stopped = serving.undeploy(req.serving_id, registry=me.registry)
    return UndeployResult(deployment_id=req.deployment_id or 0, stopped=stopped)


def reverify(req: JobRequest, me: Agent) -> VerifyResult:
    """Re-hash the deployed copy against its signature and approved digest; a
    mismatch quarantines the digest on this agent (it never loads it again) and
    fails the job with the missing/extra/changed files."""
    from gpuagent.serving.verify import describe_mismatch, trust_policy

    if not req.serving_id:
        raise JobFailed("reverify needs the agent's deployment id; none recorded")
    signed = trust(req, me)
    record = me.registry.get(req.serving_id)
    if record is None:
        raise JobFailed(f"deployment {req.serving_id} is not on this agent")
    result = serving.reverify(
        record.info.model_dir,
        req.manifest_digest,
        approved_files=record.approved_files,
        signature_path=signed.signature_path,
        policy=trust_policy(signed, deploy_spec(req, me, req.backend)),
    )
    if not result.ok:
        me.registry.quarantine(req.manifest_digest)
        why = describe_mismatch(result) or result.error
        raise JobFailed(
            f"deployed copy of {req.manifest_digest} no longer verifies ({why}); "
            "quarantined on this agent",
            result,
        )
    return result


HANDLERS: dict[str, Callable[[JobRequest, Agent], BaseModel]] = {
    "verify_source": inspect_source,
    "inspect": inspect_source,
    "compress": compress,
    "sign": sign,
    "verify": verify,
    "evaluate": evaluate,
    "load_test": load_test,
    "deploy": deploy,
    "undeploy": undeploy,
    "reverify": reverify,
}
