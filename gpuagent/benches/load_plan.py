"""Load-plan benchmark: `python -m gpuagent.benches.load_plan [--model-dir DIR ...]
[--kv-cache-dtype int8] [--threads 2] [--budget-s S]`.

Serves each model with the project's engine in its own process (as the agent's
load_test job does: `python -m gpuagent.engine serve`, the agent's small KV budget)
and runs the default load plan (`gpuagent.protocol.default_load_plan`) against it
with the plan runner. Prints, per model, the plan's wall time against its target
(the default plan must fit 90 s on the demo model on two cores; the plan's own
budget bounds it on any model) and, for information, each workload's knee, best
open-loop goodput, the prefix-cache hit rate the server reported at the knee (or
c=1) beside what the plan implies, and the points the budget skipped.

Default: the demo model, then SmolLM2-135M where `var/models/smollm2-135m` exists.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches.engine import Row
from gpuagent.loadtest.plan_runner import run_plan
from gpuagent.protocol import LoadTestReport, default_load_plan

WALL_TARGET_S = 90.0
SMOLLM2_DIR = Path("var/models/smollm2-135m")
KV_MEMORY_GB = 0.05  # what the agent gives a candidate's server (gpuagent.tasks)
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(
    model_dir: Path,
    kv_dtype: str,
    threads: int,
    port: int,
    log,
    cores: set[int] | None = None,
):
    """The engine serving `model_dir` on 127.0.0.1:`port`, in its own process (on
    `cores` when given, its affinity set before it starts a thread), logging to the
    file `log` (a pipe nobody reads would stall it once full)."""
    command = [sys.executable, "-m", "gpuagent.engine", "serve", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--kv-cache-dtype", kv_dtype, "--kv-memory-gb", str(KV_MEMORY_GB)]
    command += ["--threads", str(threads), "--served-model-name", "bench"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
        env=env,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited: {log.read()[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit("the server did not start in time")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def rows_of(name: str, report: LoadTestReport, wall_s: float, judged: bool):
    yield Row(
        f"default plan wall time, {name}",
        f"{wall_s:.1f} s",
        f"<= {WALL_TARGET_S:.0f} s" if judged else f"budget {report.budget_s:.0f} s",
        wall_s <= WALL_TARGET_S if judged else None,
    )
    for w in report.workloads:
        closed = [r for r in w.runs if r.concurrency is not None]
        knee_run = next(
            (r for r in closed if r.concurrency == w.knee_concurrency),
            closed[0] if closed else None,
        )
        hit = knee_run.prefix_cache_hit_rate if knee_run else None
        implied = knee_run.implied_prefix_cache_hit_rate if knee_run else None
        goodput = f"{w.max_goodput:.2f}/s" if w.max_goodput is not None else "-"
        yield Row(
            f"  {w.profile}: knee, goodput | hit (implied)",
            f"{w.knee_concurrency or '-'}, {goodput}",
            f"{hit or 0:.0%} ({implied or 0:.0%})",
            None,
        )
    yield Row(
        f"  points skipped for the budget, {name}",
        str(len(report.skipped_for_budget)),
        "",
        None,
    )
    for reason in report.unmeasured:
        print(f"  unmeasured: {reason}")


def bench(model_dir: Path, args) -> list[Row]:
    log = tempfile.TemporaryFile("w+")
    process, base = start_server(
        model_dir, args.kv_cache_dtype, args.threads, free_port(), log
    )
    try:
        plan = default_load_plan()
        if args.budget_s:
            plan = plan.model_copy(update={"budget_s": args.budget_s})
        started = time.perf_counter()
        report = asyncio.run(run_plan(base, plan, model="bench"))
        wall_s = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    judged = model_dir.resolve() == DEMO_MODEL_DIR.resolve()
    return list(rows_of(model_dir.name, report, wall_s, judged))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuagent.benches.load_plan")
    parser.add_argument("--model-dir", type=Path, action="append")
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-s", type=float, help="replace the plan's budget")
    args = parser.parse_args(argv)
    models = args.model_dir or [DEMO_MODEL_DIR] + (
        [SMOLLM2_DIR] if SMOLLM2_DIR.exists() else []
    )
    print(f"{'':<56} {'value':>12}  {'target':>10}  result")
    failed = 0
    for model_dir in models:
        for row in bench(model_dir, args):
            print(row.render(), flush=True)
            failed += row.ok is False
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
