"""A deploy on its placement, with real processes: the server is started with
CUDA_VISIBLE_DEVICES naming the placement's devices (read back from the started
process), the vllm preset's tensor_parallel_size and gpu_memory_utilization follow
the device set and the budget, the project's engine cuts its KV pool to the budget,
and servers the placement stops first are stopped before the new one starts."""

import json
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

from gpuagent.engine.__main__ import kv_pool_bytes, weight_bytes
from gpuagent.engine.engine import engine_kv_cache
from gpuagent.engine.loader import load_model
from gpuagent.protocol import BackendSpec, Placement, Recipe
from gpuagent.serving import deploy, loaded_deployments
from tests.gpuagent.serving import metric
from tests.gpuagent.serving_backends.conftest import (
    DEMO_MODEL,
    HEALTH_SERVER,
    new_marker,
    processes_with,
    spec_for,
    stand_in_backend,
)

GIB = 2**30
BF16 = Recipe(weights="bf16", kv_cache_dtype="bf16")
SMALL_ENGINE = {"kv_memory_gb": 0.005, "max_num_seqs": 2, "threads": 1, "device": "cpu"}
# A stand-in `vllm` that records its argv and the devices it was given, then
# serves /health.
FAKE_VLLM = f"""#!{sys.executable}
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_VLLM_OUT"], "w") as f:
    json.dump({{"argv": argv, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}, f)
port = argv[argv.index("--port") + 1]
name = argv[argv.index("--served-model-name") + 1]
os.execv(sys.executable, [sys.executable, {str(HEALTH_SERVER)!r},
         "--port", port, "--name", name])
"""


@pytest.fixture
def fake_vllm(tmp_path) -> tuple[dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "vllm"
    program.write_text(FAKE_VLLM)
    program.chmod(0o755)
    out = tmp_path / "vllm.json"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    env["FAKE_VLLM_OUT"] = str(out)
    env["CUDA_VISIBLE_DEVICES"] = "0,1,2,3,4,5,6,7"  # the agent's own: not passed on
    return env, out


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.timeout(120)
def test_the_vllm_preset_runs_on_its_devices_and_budget(approved, registry, fake_vllm):
    env, out = fake_vllm
    placement = Placement(
        devices=[2, 5], memory_budget_bytes=36 * GIB, device_memory_total_bytes=80 * GIB
    )
    spec = spec_for(
        approved,
        BackendSpec(kind="external", preset="vllm", tensor_parallel_size=2),
        placement=placement,
        recipe=BF16,
    )

    result = deploy(approved.folder, spec, registry=registry, env=env)

    assert result.ok, result.error
    seen = json.loads(out.read_text())
    assert seen["cuda"] == "2,5"
    assert flag(seen["argv"], "--tensor-parallel-size") == "2"
    assert flag(seen["argv"], "--gpu-memory-utilization") == "0.45"  # 36 / 80


def test_a_device_set_that_disagrees_with_the_tensor_parallel_size_is_refused(
    approved, registry, fake_vllm
):
    env, out = fake_vllm
    placement = Placement(
        devices=[3], memory_budget_bytes=GIB, device_memory_total_bytes=80 * GIB
    )
    spec = spec_for(
        approved,
        BackendSpec(kind="external", preset="vllm", tensor_parallel_size=2),
        placement=placement,
        recipe=BF16,
    )

    result = deploy(approved.folder, spec, registry=registry, env=env)

    assert not result.ok and result.error_code == "placement"
    assert "tensor_parallel_size is 2" in result.error
    assert not out.exists()  # nothing started


def test_the_placement_is_refused_when_its_budget_exceeds_the_device():
    with pytest.raises(ValueError, match="exceeds the device's memory"):
        Placement(devices=[0], memory_budget_bytes=81, device_memory_total_bytes=80)
    with pytest.raises(ValueError, match="distinct"):
        Placement(devices=[1, 1], memory_budget_bytes=1, device_memory_total_bytes=80)


@pytest.mark.timeout(120)
def test_servers_the_placement_stops_first_stop_before_the_new_one_starts(
    approved, registry
):
    older = new_marker()
    first = deploy(
        approved.folder,
        spec_for(approved, stand_in_backend(), served_model_name=older),
        registry=registry,
    )
    assert first.ok, first.error
    newer = new_marker()
    placement = Placement(
        devices=[0],
        memory_budget_bytes=GIB,
        device_memory_total_bytes=2 * GIB,
        stop_first=[first.deployment_id],
    )
    spec = spec_for(
        approved, stand_in_backend(), served_model_name=newer, placement=placement
    )

    second = deploy(approved.folder, spec, registry=registry)

    assert second.ok, second.error
    assert processes_with(older) == []
    (pid,) = processes_with(newer)
    assert environ_of(pid)["CUDA_VISIBLE_DEVICES"] == "0"
    assert [d.deployment_id for d in loaded_deployments(registry)] == [
        second.deployment_id
    ]


def test_the_engines_kv_pool_is_what_the_weights_leave_of_the_budget():
    assert kv_pool_bytes(5000, None, 10_000) == 5000
    assert kv_pool_bytes(5000, 12_000, 10_000) == 2000
    assert kv_pool_bytes(5000, 100_000, 10_000) == 5000
    with pytest.raises(ValueError, match="does not hold the loaded weights"):
        kv_pool_bytes(5000, 10_000, 10_000)


@pytest.mark.timeout(180)
def test_the_engine_runs_on_its_device_within_its_budget(
    approved, registry, engine_env
):
    model = load_model(DEMO_MODEL, dtype=torch.float32, device="cpu")
    weights = weight_bytes(model)
    budget = weights + 1_000_000  # leaves less than the engine's 0.005 GiB of KV
    marker = new_marker()
    placement = Placement(
        devices=[1], memory_budget_bytes=budget, device_memory_total_bytes=GIB
    )
    spec = spec_for(
        approved,
        BackendSpec(kind="engine", **SMALL_ENGINE),
        served_model_name=marker,
        placement=placement,
    )

    result = deploy(approved.folder, spec, registry=registry, env=engine_env)

    assert result.ok, result.error
    (pid,) = processes_with(marker)
    assert environ_of(pid)["CUDA_VISIBLE_DEVICES"] == "1"
    capped = engine_kv_cache(
        model.config, "int8", kv_memory_bytes=1_000_000, max_num_seqs=2
    )
    full = engine_kv_cache(
        model.config, "int8", kv_memory_bytes=int(0.005 * GIB), max_num_seqs=2
    )
    blocks = metric(result.endpoint, "engine_kv_blocks_total")
    assert blocks == capped.num_blocks < full.num_blocks
    assert httpx.get(f"{result.endpoint}/health", timeout=5).status_code == 200


@pytest.mark.timeout(180)
def test_the_engine_refuses_a_budget_its_weights_do_not_fit(
    approved, registry, engine_env
):
    placement = Placement(
        devices=[0], memory_budget_bytes=1_000_000, device_memory_total_bytes=GIB
    )
    spec = spec_for(
        approved, BackendSpec(kind="engine", **SMALL_ENGINE), placement=placement
    )

    result = deploy(approved.folder, spec, registry=registry, env=engine_env)

    assert not result.ok
    assert "does not hold the loaded weights" in result.error
    assert loaded_deployments(registry) == []
