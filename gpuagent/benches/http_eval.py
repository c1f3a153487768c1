"""Benchmark of the gate's quality evidence over HTTP against in-process, one run,
side by side: `python -m gpuagent.benches.http_eval [--model-dir DIR]
[--candidate-dir DIR] [--budget-s S] [--max-items N] [--threads N]`.

A real compressed candidate (the project's compress pipeline, w8a16 RTN weights
with an int8 KV cache by default, or a folder made before with --candidate-dir)
against its parent (bf16 KV), on the agent's evaluation settings:

- in process: both folders loaded by the engine in this process, scored exactly
  over full distributions, and again through the top-N path (the same estimator
  a server's logprobs get);
- over HTTP: both started as real processes on 127.0.0.1 through an external
  command template of the project's engine (`gpuagent.served_evidence`, the
  agent's path), scored with `evaluate.Endpoint`, stopped.

Rows: first like for like (the top-N estimate in process vs over HTTP: the same
logprobs, so the same numbers), then the issue's target (HTTP's top-N estimate,
bucketed KL plus the tail's estimated term, vs the exact in-process KL: mean KLD
within 5%, top-1 within 0.5 pt), then HTTP's bucketed lower bound alone, then per
slice.
Times: each path's wall time, in process with both models' loads, over HTTP with
both servers' starts (which load them) and stops.
The budget bounds each server's health wait and skips (and names) what it leaves
no time for.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from gpuagent.compress.pipeline import compress
from gpuagent.evaluate import EngineModel, Settings, evaluate_quality
from gpuagent.evaluate.recorded import Recording
from gpuagent.integrity import hash_model
from gpuagent.protocol import BackendSpec, DeploySpec, QualityReport, Recipe
from gpuagent.served_evidence import Server, evaluate_served, parent_spec
from gpuagent.serving import Registry

DEFAULT_MODEL_DIR = Path("var/models/smollm2-135m")
RECIPE = {"weights": "w8a16", "kv_cache_dtype": "int8"}
KLD_TOLERANCE = 0.05
TOP1_TOLERANCE = 0.005
# The project's engine through an external template: how an environment that
# takes its evidence from the serving backend starts it (float32 on a CPU, as the
# in-process side computes).
TEMPLATE = (
    "{python} -m gpuagent.engine serve {model_dir} --host {host} --port {port} "
    "--kv-cache-dtype {kv_cache_dtype} --served-model-name {served_model_names} "
    "--manifest-digest {manifest_digest} --kv-memory-gb 0.1 --max-num-seqs 1 "
    "--threads {threads} --device cpu --dtype float32"
)


def agent_settings(max_items: int) -> Settings:
    """The agent's evaluate job's settings (gpuagent.tasks.eval_settings) with
    `max_items` per slice."""
    return Settings(
        seed=0,
        continuation_tokens=4,
        passage_tokens=96,
        long_context_tokens=480,
        max_items=max_items,
    )


def server_env(threads: int) -> dict[str, str]:
    """An engine child's environment: this repository importable, `threads`
    threads, the torch references on a CPU (no Triton interpreter)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path.cwd()), env.get("PYTHONPATH", "")) if p
    )
    env.pop("TRITON_INTERPRET", None)
    return env


def by_name(report: QualityReport) -> dict:
    return {s.name: s for s in report.slices}


def row(label: str, left, right, left_s: float | None, right_s: float | None) -> str:
    """One printed comparison: mean KLD and top-1 of both, their ratio and
    difference, and each side's time."""
    ratio = right.mean_kld / left.mean_kld if left.mean_kld else float("nan")
    return (
        f"{label:<40} {left.mean_kld:>10.6f} {right.mean_kld:>10.6f} {ratio:>7.4f} "
        f"{left.same_top1 * 100:>7.2f} {right.same_top1 * 100:>7.2f} "
        f"{(right.same_top1 - left.same_top1) * 100:>+7.2f}"
        + "".join(f" {s:>8.1f}" if s is not None else "" for s in (left_s, right_s))
    )


HEADER = (
    f"{'comparison (left vs right)':<40} {'KLD left':>10} {'KLD right':>10} "
    f"{'ratio':>7} {'top1 L%':>7} {'top1 R%':>7} {'d pt':>7} {'left s':>8} "
    f"{'right s':>8}"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuagent.benches.http_eval")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--candidate-dir",
        type=Path,
        help="a candidate compressed before (default: compress one now, w8a16)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=RECIPE["kv_cache_dtype"],
        help="the candidate's KV cache (the parent's is bf16)",
    )
    parser.add_argument("--budget-s", type=float, default=1800.0)
    parser.add_argument("--max-items", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    torch.set_num_threads(args.threads)
    parent_dir = args.model_dir.resolve()
    settings = agent_settings(args.max_items)
    kv = args.kv_cache_dtype

    with tempfile.TemporaryDirectory(prefix="http-eval-") as tmp:
        candidate_dir = args.candidate_dir
        if candidate_dir is None:
            candidate_dir = Path(tmp) / "candidate"
            t0 = time.perf_counter()
            compress(parent_dir, {**RECIPE, "kv_cache_dtype": kv}, candidate_dir)
            print(
                f"compressed {parent_dir.name} to {RECIPE['weights']} (kv {kv}) in "
                f"{time.perf_counter() - t0:.1f} s"
            )
        candidate_dir = candidate_dir.resolve()

        t0 = time.perf_counter()
        candidate = EngineModel(candidate_dir, kv, max_tokens=512)
        parent = EngineModel(parent_dir, "bf16", max_tokens=512)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        # A Recording is no EngineModel: the evaluator asks it for top-N, as it
        # asks a server.
        local_top_n = evaluate_quality(
            Recording(candidate), Recording(parent), settings
        )
        top_n_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        exact = evaluate_quality(candidate, parent, settings)
        exact_s = time.perf_counter() - t0
        del candidate, parent

        left_s = deadline - time.monotonic()
        if left_s < 60:
            print(f"budget spent before the HTTP run ({left_s:.0f} s left): skipped")
            return 1
        spec = DeploySpec(
            manifest_digest=hash_model(candidate_dir).digest,
            recipe=Recipe(weights=RECIPE["weights"], kv_cache_dtype=kv),
            backend=BackendSpec(
                kind="external",
                command_template=TEMPLATE.replace("{threads}", str(args.threads)),
            ),
            served_model_name="candidate",
            health_timeout_s=min(600.0, left_s / 2),
        )
        parent_server = Server(
            parent_dir, parent_spec(spec, hash_model(parent_dir).digest, "parent")
        )
        ran = evaluate_served(
            Server(candidate_dir, spec),
            parent_server,
            settings,
            registry=Registry(Path(tmp) / "serving"),
            env=server_env(args.threads),
        )
        http = ran.report

    print(
        f"\nHTTP servers: {http.servers}; candidate {http.candidate_engine.name} "
        f"{http.candidate_engine.version}: {' '.join(http.candidate_engine.command)}"
    )
    print(
        f"in process: both models loaded in {load_s:.1f} s, scored top-"
        f"{settings.top_n} in {top_n_s:.1f} s and exactly in {exact_s:.1f} s; over "
        f"HTTP {ran.wall_s:.1f} s, both servers' starts and stops included (times "
        "below: in process with the loads)\n"
    )
    print(HEADER)
    lt, ex, ht = by_name(local_top_n), by_name(exact), by_name(http)
    print(
        row(
            f"overall top-{settings.top_n}: in-process vs HTTP",
            lt["overall"],
            ht["overall"],
            load_s + top_n_s,
            ran.wall_s,
        )
    )
    print(
        row(
            f"overall exact in-process vs HTTP top-{settings.top_n}",
            ex["overall"],
            ht["overall"],
            load_s + exact_s,
            ran.wall_s,
        )
    )
    lower = ht["overall"].model_copy(update={"mean_kld": ht["overall"].mean_kld_lower})
    print(
        row(
            "overall exact vs HTTP bucket lower bound",
            ex["overall"],
            lower,
            load_s + exact_s,
            ran.wall_s,
        )
    )
    for name in (n for n in ex if n != "overall"):
        print(row(f"  {name}: exact vs HTTP", ex[name], ht[name], None, None))
    o = ht["overall"]
    print(
        f"\nHTTP tail mass (reference mass outside the top-{settings.top_n}): mean "
        f"{o.tail_mass_mean:.4f}, max {o.tail_mass_max:.4f}; positions "
        f"{o.num_tokens} (in process {ex['overall'].num_tokens})"
    )
    ratio = o.mean_kld / ex["overall"].mean_kld
    top1 = abs(o.same_top1 - ex["overall"].same_top1)
    kld_ok = abs(ratio - 1) <= KLD_TOLERANCE
    top1_ok = top1 <= TOP1_TOLERANCE
    print(
        f"target: KLD within {KLD_TOLERANCE:.0%}: ratio {ratio:.4f} "
        f"{'met' if kld_ok else 'MISSED'}; top-1 within {TOP1_TOLERANCE * 100:.1f} pt:"
        f" {top1 * 100:.2f} pt {'met' if top1_ok else 'MISSED'}"
    )
    return 0 if kld_ok and top1_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
