"""Benchmark: `python -m gpuagent.benches.serving [--model DIR ...] [--repeats 3]`.

What the integrity checks add to a deploy on the project's engine, measured side by
side in one run for each model folder (default: the demo model, and SmolLM2-135M
under var/models/ when it is built):

- the agent's check before any process starts (`verify_for_deploy`: every file
  re-hashed against the approved digest, `inspect_model`, the recipe's weight format);
- the engine's own verify-on-load (`read_verified_files`, timed here in-process);
- a whole `deploy()` to a healthy `/health` (which includes both), and `undeploy()`.

It prints each as seconds (median of `--repeats`), the share of the deploy time the
agent's check takes, and the share both checks take (the engine's runs inside
deploy). The approval is simulated by hashing the folder first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.integrity import file_digests, hash_model, read_verified_files
from gpuagent.protocol import BackendSpec, DeploySpec, Recipe
from gpuagent.serving.deploy import deploy, undeploy
from gpuagent.serving.registry import Registry
from gpuagent.serving.verify import Trust, verify_for_deploy

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODELS = (
    DEMO_MODEL_DIR,
    REPO / "var" / "models" / "smollm2-135m",
)


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_model(model_dir: Path, repeats: int, threads: int) -> dict[str, float]:
    manifest = hash_model(model_dir)
    spec = DeploySpec(
        manifest_digest=manifest.digest,
        recipe=Recipe(weights="bf16", kv_cache_dtype="int8"),
        backend=BackendSpec(
            kind="engine", kv_memory_gb=0.05, max_num_seqs=4, threads=threads
        ),
        approved_files=file_digests(model_dir, manifest),
        health_timeout_s=600,
        port_range=(18100, 18199),
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("TRITON_INTERPRET", None)
    check, on_load, total, stop = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="rg-serving-bench-") as tmp:
        registry = Registry(tmp)
        for _ in range(repeats):
            seconds, _ = _timed(lambda: verify_for_deploy(model_dir, spec, Trust()))
            check.append(seconds)
            seconds, _ = _timed(
                lambda: read_verified_files(model_dir, spec.manifest_digest)
            )
            on_load.append(seconds)
            seconds, result = _timed(
                lambda: deploy(model_dir, spec, registry=registry, env=env)
            )
            if not result.ok:
                raise SystemExit(f"deploy of {model_dir} failed: {result.error}")
            total.append(seconds)
            seconds, _ = _timed(
                lambda r=result: undeploy(r.deployment_id, registry=registry)
            )
            stop.append(seconds)
    return {
        "bytes": sum(f.size_bytes for f in spec.approved_files),
        "check_s": statistics.median(check),
        "on_load_s": statistics.median(on_load),
        "deploy_s": statistics.median(total),
        "undeploy_s": statistics.median(stop),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpuagent.benches.serving")
    parser.add_argument("--model", type=Path, action="append", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    models = args.model or [m for m in DEFAULT_MODELS if (m / "config.json").is_file()]
    print(
        f"{'model':<16} {'MB':>7} {'agent check s':>14} {'engine verify s':>16} "
        f"{'deploy s':>9} {'check/deploy':>13} {'both/deploy':>12} "
        f"{'undeploy s':>11}"
    )
    for model_dir in models:
        r = bench_model(model_dir, args.repeats, args.threads)
        print(
            f"{model_dir.name:<16} {r['bytes'] / 1e6:>7.1f} {r['check_s']:>14.3f} "
            f"{r['on_load_s']:>16.3f} {r['deploy_s']:>9.2f} "
            f"{r['check_s'] / r['deploy_s']:>13.1%} "
            f"{(r['check_s'] + r['on_load_s']) / r['deploy_s']:>12.1%} "
            f"{r['undeploy_s']:>11.2f}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
