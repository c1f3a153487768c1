"""Gate evidence from the serving backend: the demo model's candidate (int8 KV) and
parent (bf16 KV) started as real processes on 127.0.0.1 through an external
command template (the project's engine), scored over HTTP, and stopped; the result
agrees with the in-process evaluation of the same folders."""

import os
import shutil
from pathlib import Path

import pytest

from gpuagent.evaluate import EngineModel, Settings, evaluate_quality
from gpuagent.evaluate.recorded import Recording
from gpuagent.integrity import hash_model
from gpuagent.protocol import BackendSpec, DeploySpec, Recipe
from gpuagent.served_evidence import (
    ServedError,
    Server,
    evaluate_served,
    fits_side_by_side,
    parent_spec,
    served,
)
from gpuagent.serving import Registry, deploy, loaded_deployments, undeploy
from tests.gpuagent.serving_backends.conftest import (
    DEMO_MODEL,
    REPO,
    free_port,
    new_marker,
    processes_with,
    stand_in_backend,
)

TEMPLATE = (
    "{python} -m gpuagent.engine serve {model_dir} --host {host} --port {port} "
    "--kv-cache-dtype {kv_cache_dtype} --served-model-name {served_model_names} "
    "--manifest-digest {manifest_digest} --kv-memory-gb 0.005 --max-num-seqs 1 "
    "--threads 1 --device cpu --dtype float32"
)
QUICK = Settings(
    seed=3,
    top_n=20,
    continuation_tokens=4,
    passage_tokens=96,
    long_context_tokens=480,
    slices=("english", "korean", "long_context"),
    max_items=2,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The candidate and its parent: two copies of the demo model (the candidate
    differs by its KV cache, int8), with their digests."""
    root = tmp_path_factory.mktemp("served")
    out = {}
    for name in ("candidate", "parent"):
        shutil.copytree(DEMO_MODEL, root / name)
        out[name] = (root / name, hash_model(root / name).digest)
    return out


@pytest.fixture
def registry(tmp_path):
    return Registry(tmp_path / "serving")


@pytest.fixture(scope="module")
def env():
    """An engine child's environment: one thread, the torch references on a CPU."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    return env


def servers(folders, marker: str, template: str = TEMPLATE) -> tuple[Server, Server]:
    folder, digest = folders["candidate"]
    spec = DeploySpec(
        manifest_digest=digest,
        recipe=Recipe(weights="bf16", kv_cache_dtype="int8"),
        backend=BackendSpec(kind="external", command_template=template),
        served_model_name=f"{marker}-candidate",
        port_range=(free_port(), 65000),
        health_timeout_s=120,
    )
    parent_folder, parent_digest = folders["parent"]
    parent = parent_spec(spec, parent_digest, f"{marker}-parent")
    return Server(folder, spec), Server(parent_folder, parent)


@pytest.fixture(scope="module")
def in_process(folders):
    """The same two folders scored in this process: exact KL over full
    distributions, and the top-N estimate over the same positions (a Recording
    is no EngineModel, so the evaluator asks it for top-N as it asks a server)."""
    candidate = EngineModel(folders["candidate"][0], "int8", max_tokens=512)
    parent = EngineModel(folders["parent"][0], "bf16", max_tokens=512)
    return {
        "exact": evaluate_quality(candidate, parent, QUICK),
        "top_n": evaluate_quality(Recording(candidate), Recording(parent), QUICK),
    }


def by_name(report) -> dict:
    return {s.name: s for s in report.slices}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("side_by_side", [True, False])
def test_it_agrees_with_the_in_process_evaluation(
    folders, registry, env, in_process, side_by_side
):
    marker = new_marker()
    candidate, parent = servers(folders, marker)

    ran = evaluate_served(
        candidate, parent, QUICK, registry=registry, side_by_side=side_by_side, env=env
    )

    report = ran.report
    assert report.method == "http_top_n" and report.top_n == 20
    assert report.servers == ("side_by_side" if side_by_side else "one_after_other")
    for engine in (report.candidate_engine, report.reference_engine):
        assert engine.name == "releasegate" and engine.version == "0.1.0"
        assert engine.backend == "external"
        assert engine.command[1:4] == ["-m", "gpuagent.engine", "serve"]
    assert "int8" in report.candidate_engine.command
    assert "bf16" in report.reference_engine.command
    exact, top_n = by_name(in_process["exact"]), by_name(in_process["top_n"])
    for name, measured in by_name(report).items():
        # Like for like: the same estimator over the same logprobs, which the
        # server returns bit for bit as the engine computes them in process.
        assert measured.num_tokens == top_n[name].num_tokens == exact[name].num_tokens
        assert measured.mean_kld == pytest.approx(top_n[name].mean_kld, rel=1e-6)
        assert measured.same_top1 == top_n[name].same_top1
        assert measured.flips == top_n[name].flips
        # Against the exact KL: the bucketed KL is a lower bound; with the tail's
        # estimated term the whole within the 5% (a slice within 15%), and
        # the top-1 agreement within half a point.
        assert exact[name].mean_kld > 0
        assert measured.mean_kld_lower <= exact[name].mean_kld * 1.001 + 1e-9
        assert measured.mean_kld == pytest.approx(
            exact[name].mean_kld, rel=0.05 if name == "overall" else 0.15
        )
        assert measured.same_top1 == pytest.approx(exact[name].same_top1, abs=0.005)
        assert 0 <= measured.tail_mass_mean <= measured.tail_mass_max < 1
        assert exact[name].tail_mass_mean is None
    assert loaded_deployments(registry) == []
    assert processes_with(marker) == []


@pytest.mark.timeout(300)
def test_it_stops_both_servers_when_the_evaluation_fails(folders, registry, env):
    marker = new_marker()
    candidate, parent = servers(folders, marker)
    nothing = Settings(slices=("no-such-slice",))  # fails once both are up

    with pytest.raises(ValueError, match="no scored positions"):
        evaluate_served(
            candidate, parent, nothing, registry=registry, side_by_side=True, env=env
        )

    assert loaded_deployments(registry) == []
    assert processes_with(marker) == []


@pytest.mark.timeout(300)
def test_it_stops_the_parent_when_the_candidate_does_not_start(folders, registry, env):
    marker = new_marker()
    candidate, parent = servers(folders, marker)
    broken = candidate.spec.backend.model_copy(
        update={"command_template": TEMPLATE + " --no-such-flag"}
    )
    candidate = Server(
        candidate.folder, candidate.spec.model_copy(update={"backend": broken})
    )

    with pytest.raises(ServedError, match=f"(?s){marker}-candidate.*no-such-flag"):
        evaluate_served(
            candidate, parent, QUICK, registry=registry, side_by_side=True, env=env
        )

    assert loaded_deployments(registry) == []
    assert processes_with(marker) == []


def test_external_engines_share_a_gpu_only_where_their_shares_add_up():
    vllm = BackendSpec(kind="external", preset="vllm")
    halves = vllm.model_copy(update={"gpu_memory_utilization": 0.45})

    assert not fits_side_by_side(vllm, [1, 1], None)  # 0.9 each by default
    assert fits_side_by_side(halves, [1, 1], None)


def test_the_engine_runs_both_where_the_memory_holds_them():
    engine = BackendSpec()

    assert fits_side_by_side(engine, [3, 4], 7)
    assert not fits_side_by_side(engine, [3, 4], 6)
    assert not fits_side_by_side(engine, [3, 4], None)  # unknown: one at a time


def test_the_parent_is_served_from_its_own_digest_with_a_bf16_cache(folders):
    candidate, parent = servers(folders, "x")

    assert parent.spec.manifest_digest == folders["parent"][1]
    assert parent.spec.recipe.kv_cache_dtype == "bf16"
    assert parent.spec.served_model_name == "x-parent"
    assert parent.spec.backend == candidate.spec.backend
    assert Path(parent.folder) == folders["parent"][0]


def stand_in(folders, marker: str) -> Server:
    folder, digest = folders["candidate"]
    spec = DeploySpec(
        manifest_digest=digest,
        recipe=Recipe(weights="bf16", kv_cache_dtype="int8"),
        backend=stand_in_backend(),
        served_model_name=marker,
        port_range=(free_port(), 65000),
        health_timeout_s=30,
    )
    return Server(folder, spec)


def test_a_server_it_started_is_stopped_even_when_the_block_raises(folders, registry):
    marker = new_marker()

    with pytest.raises(RuntimeError, match="scoring failed"):
        with served(stand_in(folders, marker), registry=registry) as running:
            assert processes_with(marker) and running.engine.name == "health_server.py"
            raise RuntimeError("scoring failed")

    assert processes_with(marker) == [] and loaded_deployments(registry) == []


def test_a_deployment_running_before_is_left_running(folders, registry):
    marker = new_marker()
    server = stand_in(folders, marker)
    live = deploy(server.folder, server.spec, registry=registry)
    assert live.ok, live.error
    try:
        with served(server, registry=registry) as running:
            assert running.deploy.deployment_id == live.deployment_id

        assert [d.deployment_id for d in loaded_deployments(registry)] == [
            live.deployment_id
        ]
        assert processes_with(marker)
    finally:
        undeploy(live.deployment_id, registry=registry, grace_s=2)
