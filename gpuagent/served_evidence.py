"""Gate evidence from the engine that will serve: the candidate and its parent
started on the environment's serving backend (the project's engine, an external
template, vLLM's preset) through `gpuagent.serving.deploy`, scored over HTTP by
`gpuagent.evaluate.Endpoint`, stopped afterwards whatever happened.

Both servers run side by side when memory holds both (`fits_side_by_side`); else
the parent is served first, its answers are kept (`evaluate.recorded`), and it is
stopped before the candidate starts. Each start waits for `/health` within the
spec's `health_timeout_s`; a server this module started is stopped on the way out
of `served` (success, error or interrupt), one it found running already is left
alone. Reports name each server (`ServingEngine`: name, version, command line).

It drives serving and evaluate, so it sits above both (neither imports it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuagent import serving
from gpuagent.evaluate import Endpoint, Settings, evaluate_quality
from gpuagent.evaluate.recorded import Recording
from gpuagent.protocol import (
    BackendSpec,
    DeployResult,
    DeploySpec,
    QualityReport,
    ServingEngine,
    engine_kv_budget_bytes,
)
from gpuagent.serving.deploy import DEFAULT_GPU_MEMORY_UTILIZATION
from gpuagent.serving.engine_info import describe_server

# What a model folder takes in memory once loaded, per byte on disk: the
# project's engine computes in float32 on a CPU, so bf16 files double.
LOADED_BYTES_PER_FILE_BYTE = 2


class ServedError(RuntimeError):
    """A server for the evidence did not start; the message says which and why."""


@dataclass(frozen=True)
class Server:
    """One model to serve for the evidence: its folder, its deploy spec, and the
    Trust its signature gives (None: checked against the digest only)."""

    folder: Path
    spec: DeploySpec
    trust: serving.Trust | None = None


@dataclass(frozen=True)
class Running:
    """A server up for the evidence."""

    endpoint: str
    model: str
    engine: ServingEngine
    deploy: DeployResult


@contextlib.contextmanager
def served(
    server: Server,
    *,
    registry: serving.Registry,
    env: Mapping[str, str] | None = None,
    allowed_programs: Collection[str] | None = None,
) -> Iterator[Running]:
    """`server` deployed and healthy (bounded by its spec's health_timeout_s) for
    the block; ServedError when it doesn't start (deploy leaves nothing running
    then). Stopped on the way out, however the block ends, unless it was already
    running before (a live deployment the agent keeps)."""
    before = {info.deployment_id for info in serving.loaded_deployments(registry)}
    result = serving.deploy(
        server.folder,
        server.spec,
        registry=registry,
        trust=server.trust,
        env=env,
        allowed_programs=allowed_programs,
    )
    if not result.ok:
        raise ServedError(
            f"no server for {server.spec.served_model_name or server.folder}: "
            f"{result.error}"
        )
    try:
        model = server.spec.served_model_name or None
        engine = describe_server(
            result.endpoint, server.spec.backend.kind, result.command, model
        )
        yield Running(result.endpoint, model or "", engine, result)
    finally:
        if result.deployment_id not in before:
            serving.undeploy(result.deployment_id, registry=registry)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files directly in `folder`."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where it can't be read)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def fits_side_by_side(
    backend: BackendSpec, need_bytes: Collection[int], available_bytes: int | None
) -> bool:
    """Whether the servers fit at once. An external engine claims its
    gpu_memory_utilization share of the whole GPU at start (vLLM checks that much
    is free), so two fit only where the shares add up to at most 1. The project's
    engine takes its weights as loaded plus its KV budget (`need_bytes`, one per
    server); they fit when the sum is within `available_bytes` (None: unknown,
    so one at a time)."""
    if backend.kind == "external":
        share = backend.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        return share * len(need_bytes) <= 1.0
    return available_bytes is not None and sum(need_bytes) <= available_bytes


def engine_need_bytes(folder: Path, backend: BackendSpec) -> int:
    """What the project's engine takes for `folder`: its weights as loaded and
    its KV budget (as the agent starts it: the default where none is set)."""
    kv = engine_kv_budget_bytes(backend.kv_memory_gb)
    return folder_bytes(folder) * LOADED_BYTES_PER_FILE_BYTE + kv


def available_bytes(backend: BackendSpec) -> int | None:
    """Memory the servers of `backend` draw on: the host's for the engine on a
    CPU, the GPU's free memory for the engine on CUDA."""
    if backend.kind == "engine" and backend.device not in (None, "cpu"):
        import torch  # only an engine on a GPU needs its free memory

        if not torch.cuda.is_available():
            return None
        return torch.cuda.mem_get_info(torch.device(backend.device))[0]
    return host_available_bytes()


@dataclass
class ServedEvaluation:
    """A quality evaluation over HTTP, as it ran."""

    report: QualityReport
    side_by_side: bool
    wall_s: float


def evaluate_served(
    candidate: Server,
    reference: Server,
    settings: Settings,
    *,
    registry: serving.Registry,
    side_by_side: bool | None = None,
    env: Mapping[str, str] | None = None,
    allowed_programs: Collection[str] | None = None,
    progress: Callable[[float], None] = lambda _: None,
) -> ServedEvaluation:
    """QualityReport of `candidate` against `reference`, both served on their
    specs' backend and scored over HTTP (top-N logprobs, `metrics.top_n_kld`),
    then stopped. `side_by_side` None: as memory allows (`fits_side_by_side`);
    False serves the reference first and keeps its answers."""
    backend = candidate.spec.backend
    if side_by_side is None:
        need = [engine_need_bytes(s.folder, backend) for s in (candidate, reference)]
        side_by_side = fits_side_by_side(backend, need, available_bytes(backend))
    options = {"registry": registry, "env": env, "allowed_programs": allowed_programs}
    started = time.perf_counter()
    if side_by_side:
        with (
            served(reference, **options) as ref,
            served(candidate, **options) as cand,
        ):
            progress(0.3)
            report = evaluate_quality(
                Endpoint(cand.endpoint, cand.model or None),
                Endpoint(ref.endpoint, ref.model or None),
                settings,
            )
    else:
        with served(reference, **options) as ref:
            progress(0.2)
            recording = Recording(Endpoint(ref.endpoint, ref.model or None))
            evaluate_quality(recording, recording, settings)
        progress(0.5)
        with served(candidate, **options) as cand:
            progress(0.6)
            report = evaluate_quality(
                Endpoint(cand.endpoint, cand.model or None),
                recording.replay(),
                settings,
            )
    report = report.model_copy(
        update={
            "candidate_engine": cand.engine,
            "reference_engine": ref.engine,
            "servers": "side_by_side" if side_by_side else "one_after_other",
        }
    )
    return ServedEvaluation(report, side_by_side, time.perf_counter() - started)


def parent_spec(
    candidate_spec: DeploySpec, parent_digest: str, served_model_name: str
) -> DeploySpec:
    """The DeploySpec of a candidate's parent on the candidate's backend: its own
    digest, unquantized weights read with a bf16 KV cache (the reference a
    compressed candidate is judged against), no release binding (a source is not
    signed by the agent), under another served name."""
    recipe = candidate_spec.recipe.model_copy(
        update={"weights": "bf16", "kv_cache_dtype": "bf16"}
    )
    return candidate_spec.model_copy(
        update={
            "manifest_digest": parent_digest,
            "recipe": recipe,
            "served_model_name": served_model_name,
            "release_model": "",
            "release_version": "",
            "release_recipe": "",
            "release_parent_digest": "",
            "approved_files": [],
        }
    )
