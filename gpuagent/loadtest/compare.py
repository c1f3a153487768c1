"""Benchmark: our load-test client against `guidellm` on the same endpoint, the chat
profile's lengths, the same concurrency, runs interleaved (ours, guidellm, ours,
...) so that a change in the shared machine's load hits both alike.

`python -m gpuagent.loadtest.compare [--endpoint URL --tokenizer DIR | --model-dir DIR]
[--concurrency 4] [--requests 32] [--prompt-tokens 128] [--output-tokens 64]
[--rounds 2]`

Without --endpoint it serves --model-dir (default: the demo model) with the
project's engine on a free port. guidellm runs unchanged apart from being pointed
at the endpoint (`guidellm run --backend kind=openai_http,target=URL --profile
kind=concurrent,streams=C --data kind=synthetic_text,...`).

Printed side by side: median TTFT; median ITL (ours: gaps between content chunks;
guidellm's "ITL" is per request (E2E - TTFT) / (tokens - 1), which is our TPOT, so
our TPOT median is shown beside it too); each ratio with the 10% target; and each
client's CPU per streamed token. Ours is the process CPU of the run alone;
guidellm's is its processes' CPU (rusage of children) for the run minus a
one-request run's (its start-up, imports and worker spawn), per token of the
difference.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpuagent.loadtest.client import new_session
from gpuagent.loadtest.profiles import load_profiles
from gpuagent.loadtest.prompts import build_prompts, tokenize_counter
from gpuagent.loadtest.runner import Bounds, Target, run_level
from gpuagent.loadtest.suite import discover_model

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "engine" / "demo_model"
TARGET_RATIO = 0.10


def guidellm_program() -> str | None:
    """guidellm's script beside this interpreter (a venv run without activating it),
    else the one on PATH."""
    beside = Path(sys.executable).parent / "guidellm"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("guidellm")


@dataclass
class ClientRun:
    """Medians of one client's run, and its CPU per streamed token."""

    ttft_ms: float
    itl_ms: float
    tpot_ms: float | None
    cpu_us_per_token: float
    output_tokens: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def engine_server(model_dir: Path, threads: int) -> Iterator[str]:
    """`python -m gpuagent.engine serve model_dir` on a free port: its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "gpuagent.engine", "serve", str(model_dir)]
    cmd += ["--port", str(port), "--threads", str(threads), "--log-level", "warning"]
    cmd += ["--kv-memory-gb", "0.25"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise SystemExit(
                    f"error: the engine did not start: {proc.stderr.read()}"
                )
            if time.monotonic() > deadline:
                raise SystemExit("error: the engine did not start in 180 s")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def run_ours(
    base_url: str, concurrency: int, requests: int, prompt: int, output: int
) -> ClientRun:
    """The chat profile at `concurrency` with our client."""
    profile = load_profiles()["chat"].with_lengths(prompt, output)
    target = Target(base_url, await discover_model(base_url, None))
    async with new_session(60) as session:
        prompts = await build_prompts(
            profile, await tokenize_counter(session, base_url, target.model)
        )
    run = await run_level(
        target, prompts, Bounds(requests, 600), concurrency=concurrency
    )
    if run.num_errors:
        raise SystemExit(f"error: our client's run had errors: {run.errors}")
    return ClientRun(
        ttft_ms=run.ttft_ms.p50,
        itl_ms=run.itl_ms.p50,
        tpot_ms=run.tpot_ms.p50,
        cpu_us_per_token=run.client_cpu_us_per_token,
        output_tokens=run.output_tokens,
    )


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def guidellm_once(
    base_url: str,
    tokenizer: str,
    concurrency: int,
    requests: int,
    prompt: int,
    output: int,
    folder: Path,
) -> tuple[dict, float]:
    """One `guidellm run`: its benchmark's metrics and the CPU its processes used."""
    out = folder / f"guidellm-{time.monotonic_ns()}.json"
    cmd = [guidellm_program() or "guidellm", "run"]
    cmd += ["--backend", f"kind=openai_http,target={base_url}"]
    cmd += ["--profile", f"kind=concurrent,streams={concurrency}"]
    cmd += ["--constraint", f"kind=max_requests,count={requests}"]
    cmd += [
        "--data",
        f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
    ]
    cmd += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer}"]
    cmd += ["--output", f"kind=json,path={out}", "--disable-console"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    before = children_cpu_s()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    cpu = children_cpu_s() - before
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"error: guidellm failed: {done.stderr[-2000:]}")
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    failed = len(benchmark["requests"].get("errored") or [])
    if failed:
        raise SystemExit(f"error: {failed} guidellm requests failed")
    return benchmark["metrics"], cpu


def run_guidellm(
    base_url: str,
    tokenizer: str,
    concurrency: int,
    requests: int,
    prompt: int,
    output: int,
) -> ClientRun:
    """The same load with guidellm; CPU per token net of a one-request run's."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        metrics, cpu = guidellm_once(
            base_url, tokenizer, concurrency, requests, prompt, output, folder
        )
        _, base_cpu = guidellm_once(base_url, tokenizer, 1, 1, prompt, output, folder)
    tokens = int(metrics["output_token_count"]["successful"]["total_sum"])
    net_tokens = max(tokens - output, 1)
    return ClientRun(
        ttft_ms=metrics["time_to_first_token_ms"]["successful"]["median"],
        itl_ms=metrics["inter_token_latency_ms"]["successful"]["median"],
        tpot_ms=None,
        cpu_us_per_token=max(cpu - base_cpu, 0.0) * 1e6 / net_tokens,
        output_tokens=tokens,
    )


def ratio_row(name: str, ours: float, theirs: float) -> str:
    ratio = ours / theirs if theirs else float("inf")
    verdict = "PASS" if abs(ratio - 1) <= TARGET_RATIO else "FAIL"
    return f"{name:<44}{ours:>10.2f}{theirs:>10.2f}{ratio:>9.3f}  within 10%: {verdict}"


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `python -m gpuagent.loadtest.compare`."""
    parser = argparse.ArgumentParser(prog="python -m gpuagent.loadtest.compare")
    parser.add_argument("--endpoint", help="base URL (default: serve --model-dir)")
    parser.add_argument("--model-dir", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--tokenizer", help="folder guidellm loads the tokenizer from")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="the engine's")
    args = parser.parse_args(argv)
    if guidellm_program() is None:
        raise SystemExit("error: guidellm is not installed (pip install -e '.[dev]')")
    tokenizer = args.tokenizer or str(args.model_dir.resolve())
    load = (args.concurrency, args.requests, args.prompt_tokens, args.output_tokens)
    server = (
        contextlib.nullcontext(args.endpoint.rstrip("/").removesuffix("/v1"))
        if args.endpoint
        else engine_server(args.model_dir, args.threads)
    )
    ours: list[ClientRun] = []
    theirs: list[ClientRun] = []
    with server as base_url:
        asyncio.run(run_ours(base_url, 1, 2, *load[2:]))  # warm-up
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}: ours", file=sys.stderr)
            ours.append(asyncio.run(run_ours(base_url, *load)))
            print(f"round {round_index + 1}/{args.rounds}: guidellm", file=sys.stderr)
            theirs.append(run_guidellm(base_url, tokenizer, *load))

    def median(runs: list[ClientRun], field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs)

    print(
        f"chat profile, {args.prompt_tokens} prompt + {args.output_tokens} output "
        f"tokens, concurrency {args.concurrency}, {args.requests} requests x "
        f"{args.rounds} rounds, interleaved"
    )
    print(f"{'':<44}{'ours':>10}{'guidellm':>10}{'ratio':>9}")
    print(
        ratio_row("median TTFT, ms", median(ours, "ttft_ms"), median(theirs, "ttft_ms"))
    )
    print(
        ratio_row(
            "median ITL, ms (chunk gaps vs guidellm's)",
            median(ours, "itl_ms"),
            median(theirs, "itl_ms"),
        )
    )
    print(
        ratio_row(
            "median TPOT, ms (vs guidellm's per-request ITL)",
            median(ours, "tpot_ms"),
            median(theirs, "itl_ms"),
        )
    )
    cpu_ours, cpu_theirs = (
        median(ours, "cpu_us_per_token"),
        median(theirs, "cpu_us_per_token"),
    )
    print(
        f"{'client CPU per streamed token, us':<44}{cpu_ours:>10.1f}"
        f"{cpu_theirs:>10.1f}{cpu_ours / cpu_theirs if cpu_theirs else 0:>9.3f}"
    )


if __name__ == "__main__":
    main()
