"""GPU placement on a real device, one short prepared run: the engine's CUDA path
under the control plane's placement (CUDA_VISIBLE_DEVICES and a memory budget per
server, gpuagent.serving.deploy.placed_env), as an agent starts it.

On one device it starts a pair of servers of `--model-dir` whose budgets share
the device (the warm rollback target beside the live release), checks that each
answers a completion, reads each process's device memory (nvidia-smi) against
its budget, then stops one and restarts it, timing the cold restart a rollback
to a target kept on disk pays against a warm one (its server answering at once).
A last server gets a budget its weights don't fit in and must refuse to start.
Prints one row per check with PASS/FAIL; exit status 1 when any fails, 2 when no
CUDA device is visible (nothing measured).

    python -m gpuagent.benches.gpu_placement --model-dir var/models/smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches.load_plan import free_port
from gpuagent.protocol import Placement
from gpuagent.serving.deploy import placed_env

START_TIMEOUT_S = 300.0
# The CUDA context and the allocator's slack come on top of what the engine
# counts (weights + KV pool) in its budget.
CONTEXT_ALLOWANCE_BYTES = 1 << 30


def start(model_dir: Path, placement: Placement, log: Path) -> tuple:
    """The engine serving `model_dir` on `placement`, as the agent starts it;
    (process, base url, seconds to healthy)."""
    port = free_port()
    command = [sys.executable, "-m", "gpuagent.engine", "serve", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--device", "cuda"]
    command += ["--memory-budget-bytes", str(placement.memory_budget_bytes)]
    command += ["--served-model-name", "bench"]
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env=placed_env(dict(os.environ), placement),
    )
    base = f"http://127.0.0.1:{port}"
    while time.monotonic() - started < START_TIMEOUT_S:
        if process.poll() is not None:
            return process, None, time.monotonic() - started
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, base, time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    return process, None, time.monotonic() - started


def answers(base: str) -> bool:
    body = {"model": "bench", "prompt": "The capital of France is", "max_tokens": 8}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    return response.status_code == 200 and bool(response.json()["choices"][0]["text"])


def device_memory_by_pid() -> dict[int, int]:
    """Each compute process's device memory in bytes (nvidia-smi; {} without it)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    used = {}
    for line in out.strip().splitlines():
        pid, mib = (part.strip() for part in line.split(","))
        used[int(pid)] = int(mib) << 20
    return used


def row(what: str, value: str, ok: bool | None) -> bool:
    verdict = "" if ok is None else ("PASS" if ok else "FAIL")
    print(f"{what:<58} {value:>28} {verdict}", flush=True)
    return ok is not False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device is visible: nothing measured", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(args.device).total_memory
    weights = sum(f.stat().st_size for f in args.model_dir.glob("*.safetensors"))
    share = Placement(
        devices=[args.device],
        memory_budget_bytes=int(0.4 * total),
        device_memory_total_bytes=total,
    )
    print(f"{torch.cuda.get_device_name(args.device)}, {total / 2**30:.1f} GiB")
    print(f"model {args.model_dir} ({weights / 2**20:.0f} MiB of files)")
    ok = True
    logs = Path(tempfile.mkdtemp(prefix="gpu-placement-"))
    servers, bases = [], []
    try:
        for name in ("live", "warm rollback target"):
            process, base, seconds = start(args.model_dir, share, logs / f"{name}.log")
            servers.append(process)
            bases.append(base)
            ok &= row(f"{name}: starts on its budget", f"{seconds:.1f} s", bool(base))
            if base:
                ok &= row(f"{name}: answers a completion", "", answers(base))
        used = device_memory_by_pid()
        for process, name in zip(
            servers[:2], ("live", "warm rollback target"), strict=True
        ):
            mem = used.get(process.pid)
            limit = share.memory_budget_bytes + CONTEXT_ALLOWANCE_BYTES
            ok &= row(
                f"{name}: device memory <= budget + 1 GiB context",
                "not reported" if mem is None else f"{mem / 2**30:.2f} GiB",
                None if mem is None else mem <= limit,
            )
        started = time.monotonic()
        warm_ok = answers(bases[1]) if bases[1] else False
        warm_s = time.monotonic() - started
        servers[1].terminate()
        servers[1].wait(30)
        process, cold_base, cold_s = start(args.model_dir, share, logs / "cold.log")
        servers.append(process)
        ok &= row(
            "rollback to a cold target: restart to healthy",
            f"{cold_s:.1f} s",
            bool(cold_base),
        )
        row("rollback to a warm target: first answer", f"{warm_s:.2f} s", warm_ok)
        tight = Placement(
            devices=[args.device],
            memory_budget_bytes=max(1, weights // 4),
            device_memory_total_bytes=total,
        )
        process, base, _ = start(args.model_dir, tight, logs / "tight.log")
        servers.append(process)
        ok &= row("a budget the weights don't fit in: refused", "", base is None)
    finally:
        for process in servers:
            if process.poll() is None:
                process.kill()
    print(f"server logs: {logs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
