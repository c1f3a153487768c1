"""deploy / undeploy / re-verify of a serving engine for one approved release.

Order of a deploy: the backend's command is built (a bad template is refused before
any hashing), the folder is verified against the approved digest (and signature)
with nothing started, a port is picked, the server starts in its own process group,
`/health` is awaited within `health_timeout_s`, and only then is the deployment
recorded. Any failure after the start stops the whole process group: no orphans.
"""

from __future__ import annotations

import math
import os
import re
import sys
import uuid
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from pathlib import Path

from gpuagent.integrity import Policy
from gpuagent.protocol import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_MODEL_LEN,
    BackendSpec,
    DeploymentInfo,
    DeployResult,
    DeploySpec,
    Placement,
    RollbackCheck,
    VerifyResult,
)
from gpuagent.serving import process
from gpuagent.serving.errors import (
    DeployRefusedError,
    PortTaken,
    ServingError,
    StartError,
    TemplateError,
)
from gpuagent.serving.registry import DeploymentRecord, Registry
from gpuagent.serving.templates import (
    check_allowed_shape,
    placeholders,
    preset_template,
    quantization_args,
    redacted_command,
    render_command,
)
from gpuagent.serving.verify import (
    FolderFormat,
    Trust,
    check_not_quarantined,
    check_weight_format,
    describe_mismatch,
    reverify,
    trust_policy,
    verify_for_deploy,
)

# Fields of BackendSpec only the project's engine reads, and only an external one.
ENGINE_ONLY_FIELDS = ("kv_memory_gb", "max_num_seqs", "threads", "device")
EXTERNAL_ONLY_FIELDS = ("max_model_len", "gpu_memory_utilization")
# An external engine's defaults (gpuagent.protocol): the context it plans its KV
# cache for (capped at the model's max_position_embeddings: a full 128k+ context
# would not fit beside big weights, and vLLM refuses to start when it can't), and
# its share of the GPU when no placement gives it a budget.


# Ports tried when the one found free is taken before the server binds it.
PORT_RACE_ATTEMPTS = 5


def engine_dtype(weights: str) -> str:
    """The engine's --dtype for a recipe's weight format. "auto" computes in bf16 on
    CUDA and in fp32 on a CPU (whose bf16 matmuls are slow); a compressed-tensors
    checkpoint (int8/int4/fp8 weights, checked by verify.check_weight_format) keeps
    its quantized Linears and runs the rest at that dtype."""
    return "float16" if weights == "fp16" else "auto"


def deploy(
    model_dir: str | os.PathLike[str],
    spec: DeploySpec,
    *,
    registry: Registry,
    trust: Trust | None = None,
    env: Mapping[str, str] | None = None,
    stop_grace_s: float = 10.0,
    allowed_programs: Collection[str] | None = None,
) -> DeployResult:
    """Verify `model_dir` against `spec.manifest_digest` (and `trust`'s signature),
    start `spec.backend`'s server for it, wait for `/health`, record it in
    `registry` and return its endpoint.

    Never raises for a refusal or a failed start: the result has `ok=False`, an
    `error` naming the reason, `error_code`, and for a mismatch the `missing`,
    `extra` and `changed` files. A refusal starts no process; a failed start leaves
    none running. `env` is the server's environment (default: this process's),
    without secrets (`server_env`). Idempotent: when this agent already runs the
    same digest from the same folder under the same backend and name, and that
    copy still verifies and answers `/health`, its result is returned again.
    `allowed_programs` (the agent's own setting): the whole argument shapes an
    external backend may start, each a preset's name ("vllm") or a command template
    its template must equal word for word (`templates.check_allowed_shape`); None:
    any."""
    model_dir = Path(model_dir).absolute()
    trust = trust or Trust()
    deployment_id = (
        f"{spec.manifest_digest.rpartition(':')[2][:12]}-{uuid.uuid4().hex[:8]}"
    )
    backend = spec.backend.kind
    names = served_model_names(spec, model_dir)
    name = names[0]
    try:
        template, kv_value = _backend_template(spec)  # refused before any hashing
        if template and allowed_programs is not None:
            check_allowed_shape(template, allowed_programs)
        check_placement(spec)
        quarantined = registry.quarantined()
        check_not_quarantined(spec.manifest_digest, spec, quarantined)
        same = _running_copy(model_dir, spec, name, registry)
        if same is not None:  # a redelivered deploy job: the server it started
            found = _reuse(same, spec, trust, registry, stop_grace_s)
            if found is not None:
                return found
        manifest, approved = verify_for_deploy(
            model_dir, spec, trust, quarantined=quarantined
        )
        folder = check_weight_format(model_dir, spec.recipe.weights)
        if backend == "external":
            check_kv_scale_strategy(folder, spec.backend)
        if spec.placement is not None:
            # Room the control plane made: servers the budget doesn't hold beside
            # this one stop now, after the checks (a refusal stops nothing).
            for serving_id in spec.placement.stop_first:
                undeploy(serving_id, registry=registry, grace_s=stop_grace_s)
        host = spec.backend.host
        log_path = registry.log_path(deployment_id)
        # A port found free can be taken before the child binds it (another agent
        # or job on this host starting a server at once): then the next one.
        low, high = spec.port_range
        for attempt in range(1 if spec.port is not None else PORT_RACE_ATTEMPTS):
            port = process.pick_port(host, spec.port, (low, high))
            if backend == "engine":
                argv = _engine_argv(model_dir, spec, trust, host, port, names)
                check_name: str | None = name
            else:
                argv = render_command(
                    template,
                    {
                        "python": sys.executable,
                        "model_dir": str(model_dir),
                        "host": host,
                        "port": str(port),
                        "kv_cache_dtype": kv_value,
                        "served_model_name": name,
                        "served_model_names": names,
                        "tensor_parallel_size": str(spec.backend.tensor_parallel_size),
                        "manifest_digest": spec.manifest_digest,
                        **external_settings(spec.backend, folder, spec.placement),
                    },
                )
                named = ("{served_model_name}", "{served_model_names}")
                check_name = name if any(p in template for p in named) else None
            pid, started = process.spawn(
                argv, log_path, placed_env(server_env(env), spec.placement)
            )
            local_url = f"http://{_local_host(host)}:{port}"
            try:
                process.wait_healthy(
                    local_url,
                    pid,
                    started,
                    spec.health_timeout_s,
                    served_model_name=check_name,
                    log_path=log_path,
                )
                break
            except PortTaken:
                process.stop(pid, started, stop_grace_s)
                if spec.port is not None or attempt + 1 == PORT_RACE_ATTEMPTS:
                    raise
                low = port + 1
            except StartError as e:
                process.stop(pid, started, stop_grace_s)  # no server left unrecorded
                # The engine refused what it read (verify-on-load): name the files.
                after = reverify(
                    model_dir, spec.manifest_digest, approved_files=approved
                )
                if after.ok:
                    raise
                raise DeployRefusedError(
                    f"the folder changed after the agent's check: {e}",
                    code="changed-during-start",
                    missing=after.missing,
                    extra=after.extra,
                    changed=after.changed,
                ) from None
            except BaseException:
                process.stop(pid, started, stop_grace_s)  # no server left unrecorded
                raise
        endpoint = f"http://{spec.backend.advertise_host or _local_host(host)}:{port}"
        try:
            if backend == "external":
                # An external engine reads the files itself: check that what it
                # read while starting is still the approved bytes.
                after = reverify(
                    model_dir, spec.manifest_digest, approved_files=approved
                )
                if not after.ok:
                    raise DeployRefusedError(
                        "the folder changed while the external engine started: "
                        + describe_mismatch(after),
                        code="changed-during-start",
                        missing=after.missing,
                        extra=after.extra,
                        changed=after.changed,
                    )
            info = DeploymentInfo(
                deployment_id=deployment_id,
                manifest_digest=spec.manifest_digest,
                endpoint=endpoint,
                backend=backend,
                served_model_name=name,
                model_dir=str(model_dir),
                pid=pid,
                started=datetime.now(UTC),
            )
            registry.add(
                DeploymentRecord(
                    info=info,
                    process_start_time=started,
                    log_path=str(log_path),
                    local_url=local_url,
                    approved_files=approved,
                    command=redacted_command(argv),
                )
            )
        except BaseException:
            process.stop(pid, started, stop_grace_s)  # no server left unrecorded
            raise
    except ServingError as e:
        lists = {}
        if isinstance(e, DeployRefusedError):
            lists = {"missing": e.missing, "extra": e.extra, "changed": e.changed}
        return DeployResult(
            ok=False,
            manifest_digest=spec.manifest_digest,
            error=str(e),
            error_code=e.code,
            backend=backend,
            **lists,
        )
    return DeployResult(
        ok=True,
        endpoint=endpoint,
        manifest_digest=spec.manifest_digest,
        deployment_id=deployment_id,
        backend=backend,
        command=redacted_command(argv),
    )


def external_settings(
    backend: BackendSpec, folder: FolderFormat, placement: Placement | None = None
) -> dict:
    """The values of an external template's format and memory placeholders for a
    verified folder: `{quantization_args}` from its quantization_config,
    `{max_model_len}` (the backend's, else DEFAULT_MAX_MODEL_LEN capped at the
    model's max_position_embeddings), `{gpu_memory_utilization}` (the placement's
    budget over its devices' memory, else the backend's, else the default)."""
    max_len = backend.max_model_len
    if max_len is None:
        max_len = min(
            DEFAULT_MAX_MODEL_LEN,
            folder.max_position_embeddings or DEFAULT_MAX_MODEL_LEN,
        )
    memory = backend.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    if placement is not None:
        memory = placement_utilization(placement)
    return {
        "quantization_args": quantization_args(folder.quantized),
        "max_model_len": str(max_len),
        "gpu_memory_utilization": f"{memory:g}",
    }


def placement_utilization(placement: Placement) -> float:
    """The share of each device's memory an engine may claim for `placement`'s
    budget, rounded down to 1/1000 (never above the budget)."""
    share = placement.memory_budget_bytes / placement.device_memory_total_bytes
    return max(math.floor(share * 1000) / 1000, 0.001)


def check_placement(spec: DeploySpec) -> None:
    """DeployRefusedError (code "placement") for a placement the backend can't
    keep: an external engine shards over exactly its tensor_parallel_size
    devices, and the project's engine runs on one."""
    placement = spec.placement
    if placement is None:
        return
    wanted = spec.backend.tensor_parallel_size
    if len(placement.devices) != wanted:
        raise DeployRefusedError(
            f"the placement gives devices {placement.cuda_visible_devices} but the "
            f"backend's tensor_parallel_size is {wanted}: they must agree",
            code="placement",
        )


def placed_env(env: dict[str, str], placement: Placement | None) -> dict[str, str]:
    """A server's environment on its placement: CUDA_VISIBLE_DEVICES names its
    devices (it sees them as cuda:0.. in that order), whatever the agent's own
    environment said."""
    if placement is None:
        return env
    return {**env, "CUDA_VISIBLE_DEVICES": placement.cuda_visible_devices}


def check_kv_scale_strategy(folder: FolderFormat, backend: BackendSpec) -> None:
    """Per-head fp8 KV scales go only to an external engine whose environment says
    its attention backend reads them (vLLM: FlashAttention 3/4); DeployRefusedError
    otherwise, before anything starts. Per-tensor scales every backend reads."""
    if (
        folder.kv_scale_strategy == "attn_head"
        and backend.kv_scale_strategy != "attn_head"
    ):
        raise DeployRefusedError(
            "the release carries per-head fp8 KV scales (kv_cache_scheme strategy "
            "attn_head) but this environment's backend takes per-tensor scales "
            "(kv_scale_strategy tensor); recompress for it, or set "
            "kv_scale_strategy attn_head where the engine reads per-head scales",
            code="kv-scale-layout",
        )


def served_model_names(spec: DeploySpec, model_dir: Path) -> list[str]:
    """The names a deployment answers to, the first the one its answers carry:
    `spec.served_model_name`, else the release's model name (what the dashboard
    shows), else the folder's path; then `model@version` when the release is
    known, so that a client can pin the version it tested."""
    name = spec.served_model_name or spec.release_model or str(model_dir)
    names = [name]
    if spec.release_model and spec.release_version:
        pinned = f"{spec.release_model}@{spec.release_version}"
        if pinned != name:
            names.append(pinned)
    return names


def undeploy(deployment_id: str, *, registry: Registry, grace_s: float = 10.0) -> bool:
    """Stop the deployment's server (SIGTERM to its process group, SIGKILL after
    `grace_s`) and forget it. Idempotent: an unknown or already stopped deployment
    returns False; True when a running server was stopped."""
    record = registry.get(deployment_id)
    if record is None:
        return False
    was_running = process.stop(record.info.pid, record.process_start_time, grace_s)
    registry.remove(deployment_id)
    return was_running


def loaded_deployments(registry: Registry) -> list[DeploymentInfo]:
    """The deployments whose servers run now (for heartbeats), oldest first."""
    return [r.info for r in registry.records()]


def recover_deployments(
    registry: Registry, *, stop: bool = False, grace_s: float = 10.0
) -> list[DeploymentInfo]:
    """For an agent that (re)starts: the servers its state file names that still
    run (pid and start time both match), records of dead ones dropped. With
    `stop=True` they are all stopped and forgotten instead; returns what was found."""
    found = loaded_deployments(registry)
    if stop:
        for info in found:
            undeploy(info.deployment_id, registry=registry, grace_s=grace_s)
    return found


def reverify_deployment(
    deployment_id: str,
    *,
    registry: Registry,
    signature_path: str | os.PathLike[str] | None = None,
    policy: Policy | None = None,
) -> VerifyResult:
    """`reverify` of a running deployment's folder against the digest and per-file
    digests verified when it was deployed. Raises ServingError for an unknown id."""
    record = _record(deployment_id, registry)
    return reverify(
        record.info.model_dir,
        record.info.manifest_digest,
        approved_files=record.approved_files,
        signature_path=signature_path,
        policy=policy,
    )


def check_rollback_target(
    deployment_id: str,
    *,
    registry: Registry,
    signature_path: str | os.PathLike[str] | None = None,
    policy: Policy | None = None,
) -> RollbackCheck:
    """Whether traffic may go back to `deployment_id`: its server runs, its copy
    re-hashes to the approved digest now, and its `/health` answers."""
    record = registry.get(deployment_id)
    if record is None or not record.running():
        return RollbackCheck(
            ok=False, reason=f"deployment {deployment_id} is not running on this agent"
        )
    try:
        result = reverify_deployment(
            deployment_id,
            registry=registry,
            signature_path=signature_path,
            policy=policy,
        )
    except ServingError as e:
        return RollbackCheck(ok=False, reason=f"re-verification failed: {e}")
    healthy = process.health_ok(record.local_url)
    reasons = []
    if not result.ok:
        reasons.append(
            "its files differ from the approved manifest: "
            + (describe_mismatch(result) or result.error)
        )
    if not healthy:
        reasons.append(f"{record.local_url}/health does not answer 200")
    return RollbackCheck(
        ok=not reasons, reason="; ".join(reasons), verify=result, healthy=healthy
    )


# Variables of the agent's own environment a server must not inherit: the broker's
# and database's credentials, keys and tokens.
SECRET_ENV = re.compile(
    r"(SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|PRIVATE|_KEY$|^CELERY_|DATABASE_URL)"
)
# Nothing downloads at run time: a hub-aware engine must not fetch a missing file.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def server_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A server's environment: `env` (default: this process's) without the agent's
    secrets (see SECRET_ENV), with the hub clients offline."""
    source = os.environ if env is None else env
    kept = {k: v for k, v in source.items() if not SECRET_ENV.search(k.upper())}
    return {**kept, **OFFLINE_ENV}


def _local_host(host: str) -> str:
    """Where this agent reaches a server that listens on `host`."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else "[::1]" if host == "::" else host


def _running_copy(
    model_dir: Path, spec: DeploySpec, name: str, registry: Registry
) -> DeploymentRecord | None:
    """A running deployment of the same digest, folder, backend and name."""
    for record in registry.records():
        info = record.info
        if (
            info.manifest_digest == spec.manifest_digest
            and info.model_dir == str(model_dir)
            and info.backend == spec.backend.kind
            and info.served_model_name == name
            and (spec.port is None or info.endpoint.endswith(f":{spec.port}"))
        ):
            return record
    return None


def _reuse(
    record: DeploymentRecord,
    spec: DeploySpec,
    trust: Trust,
    registry: Registry,
    stop_grace_s: float,
) -> DeployResult | None:
    """The result of a deploy that finds its server already running: that server
    when its folder still verifies and it answers `/health` (deploy is idempotent);
    a refusal with the file lists when the folder changed; None (after stopping
    it) when it no longer answers, so that a fresh one is started."""
    deployment_id = record.info.deployment_id
    check = check_rollback_target(
        deployment_id,
        registry=registry,
        signature_path=trust.signature_path,
        policy=trust_policy(trust, spec),
    )
    if check.ok:
        return DeployResult(
            ok=True,
            endpoint=record.info.endpoint,
            manifest_digest=spec.manifest_digest,
            deployment_id=deployment_id,
            backend=record.info.backend,
            command=record.command,
        )
    if check.verify is not None and not check.verify.ok:
        why = describe_mismatch(check.verify) or check.verify.error
        raise DeployRefusedError(
            f"deployment {deployment_id} runs, but its folder no longer matches the "
            f"approved manifest: {why}",
            code="manifest-mismatch",
            missing=check.verify.missing,
            extra=check.verify.extra,
            changed=check.verify.changed,
        )
    undeploy(deployment_id, registry=registry, grace_s=stop_grace_s)
    return None


def _record(deployment_id: str, registry: Registry) -> DeploymentRecord:
    record = registry.get(deployment_id)
    if record is None:
        raise ServingError(f"no deployment {deployment_id} on this agent")
    return record


def _backend_template(spec: DeploySpec) -> tuple[str, str]:
    """(template, KV flag value) of an external backend; ("", "") for the engine.
    Settings the chosen backend would not read are refused, never ignored."""
    backend = spec.backend
    kv = spec.recipe.kv_cache_dtype
    if backend.kind == "engine":
        if backend.preset or backend.command_template:
            raise TemplateError(
                "the engine backend takes no preset or command template"
            )
        if backend.tensor_parallel_size != 1:
            raise TemplateError(
                "the engine backend serves on one device (tensor_parallel_size 1); "
                "use an external backend such as the vllm preset"
            )
        unread = [f for f in EXTERNAL_ONLY_FIELDS if getattr(backend, f) is not None]
        if unread:
            raise TemplateError(
                f"{', '.join(unread)} are settings of an external engine; the "
                "engine backend takes kv_memory_gb and max_num_seqs"
            )
        return "", ""
    ignored = [f for f in ENGINE_ONLY_FIELDS if getattr(backend, f) is not None]
    if ignored:
        raise TemplateError(
            f"{', '.join(ignored)} are settings of the engine backend; an external "
            "engine takes its settings in its command template"
        )
    if bool(backend.preset) == bool(backend.command_template):
        raise TemplateError(
            "an external backend needs exactly one of preset or command_template"
        )
    if backend.preset:
        return preset_template(backend.preset, kv)
    used = placeholders(backend.command_template)
    unread = [
        f
        for f in EXTERNAL_ONLY_FIELDS
        if getattr(backend, f) is not None and f not in used
    ]
    if unread:
        raise TemplateError(
            f"{', '.join(unread)} set, but the command template has no "
            + ", ".join("{" + f + "}" for f in unread)
            + " to pass it on"
        )
    return backend.command_template, kv


def _engine_argv(
    model_dir: Path,
    spec: DeploySpec,
    trust: Trust,
    host: str,
    port: int,
    names: list[str],
) -> list[str]:
    """`python -m gpuagent.engine serve` with verify-on-load: the engine hashes the
    bytes it loads against the same digest (and signature) the agent checked."""
    backend = spec.backend
    argv = [sys.executable, "-m", "gpuagent.engine", "serve", str(model_dir)]
    argv += ["--host", host, "--port", str(port)]
    argv += ["--kv-cache-dtype", spec.recipe.kv_cache_dtype]
    argv += ["--dtype", engine_dtype(spec.recipe.weights)]
    argv += ["--served-model-name", *names]
    argv += ["--manifest-digest", spec.manifest_digest]
    if spec.placement is not None:
        argv += ["--memory-budget-bytes", str(spec.placement.memory_budget_bytes)]
    for flag, value in (
        ("--kv-memory-gb", backend.kv_memory_gb),
        ("--max-num-seqs", backend.max_num_seqs),
        ("--threads", backend.threads),
        ("--device", backend.device),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if trust.signature_path is not None:
        argv += ["--signature", str(trust.signature_path)]
        for key in trust.public_keys:
            argv += ["--public-key", str(key)]
        for flag, value in (
            ("--certificate-chain", trust.certificate_chain),
            ("--sigstore-trust-config", trust.sigstore_trust_config),
            ("--identity", trust.identity),
            ("--issuer", trust.issuer),
        ):
            if value is not None:
                argv += [flag, str(value)]
        argv += ["--release-model", spec.release_model]
        argv += ["--release-version", spec.release_version]
        argv += ["--release-recipe", spec.release_recipe]
        argv += ["--release-parent-digest", spec.release_parent_digest]
    return argv
