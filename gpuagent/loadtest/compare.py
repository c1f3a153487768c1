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

Both clients send the same requests, as the server counts them: guidellm's
synthetic prompt has --prompt-tokens of text (by its tokenizer's count, which
includes the BOS it adds: one token fewer here), to which the server adds the chat
template, so ours is asked for the text plus the template's tokens; guidellm sets
no temperature, so ours sends none either (the server samples at its default,
which costs it more per step than greedy); both ask for --output-tokens with
ignore_eos. The prompt and output tokens per request the server reported to each
are printed, so a mismatch shows.

Printed side by side, with the 10% target: median TTFT (sent -> first content
chunk; ours starts the clock at the call, guidellm when the headers go out, some
0.1-0.5 ms later on a reused connection) and median ITL by guidellm's definition,
per request (E2E - TTFT) / (tokens - 1) (ours calls it TPOT). Then, without a
target: our median gap between content chunks (vLLM's ITL; a chunk may carry
several tokens, guidellm has no such number); the server's own mean TTFT and ITL
over each client's runs (its /metrics histograms), which tell a server that was
slower during one client's runs from clients that measure differently; and each
client's CPU per streamed token. Ours is the process CPU of the run alone;
guidellm's is its processes' CPU (rusage of children) for the run minus that of a
run at the same concurrency with one request per stream (its start-up, imports and
one worker process spawned per stream), per token of the difference.

The engine it serves runs on its own --threads cores and both clients on the
rest (guidellm's processes inherit the affinity; nothing in guidellm changes), so
a client's CPU is not taken from the server. --shared-cores lets them share every
core, as a machine with no core to spare would: then a heavier client slows the
server, and the server's own rows show how much slower it was during that
client's runs.
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
from dataclasses import astuple, dataclass, replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gpuagent.loadtest.client import new_session
from gpuagent.loadtest.profiles import Profile, load_profiles
from gpuagent.loadtest.prompts import build_prompts, tokenize_counter
from gpuagent.loadtest.runner import Bounds, Target, run_level
from gpuagent.loadtest.suite import discover_model

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "engine" / "demo_model"
TARGET_RATIO = 0.10
# The server's latency histograms: this engine's names, then vLLM's.
SERVER_TTFT = ("engine_time_to_first_token_seconds", "vllm:time_to_first_token_seconds")
SERVER_ITL = (
    "engine_inter_token_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
)


GUIDELLM_VENV = Path("var/guidellm-venv")  # `make guidellm`


def guidellm_program() -> str | None:
    """$GUIDELLM, else guidellm's own virtualenv (`make guidellm`), else the script
    beside this interpreter (a venv run without activating it), else the one on
    PATH."""
    for candidate in (
        os.environ.get("GUIDELLM"),
        GUIDELLM_VENV / "bin" / "guidellm",
        Path(sys.executable).parent / "guidellm",
    ):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(Path(candidate).absolute())
    return shutil.which("guidellm")


@dataclass
class ServerLatency:
    """Sums and counts of the server's TTFT and ITL histograms (zeros: none)."""

    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    itl_sum_s: float = 0.0
    itl_count: float = 0.0

    def __sub__(self, before: ServerLatency) -> ServerLatency:
        pairs = zip(astuple(self), astuple(before), strict=True)
        return ServerLatency(*(a - b for a, b in pairs))

    def __add__(self, other: ServerLatency) -> ServerLatency:
        pairs = zip(astuple(self), astuple(other), strict=True)
        return ServerLatency(*(a + b for a, b in pairs))

    @property
    def ttft_mean_ms(self) -> float | None:
        return self.ttft_sum_s * 1e3 / self.ttft_count if self.ttft_count else None

    @property
    def itl_mean_ms(self) -> float | None:
        return self.itl_sum_s * 1e3 / self.itl_count if self.itl_count else None


def read_server_latency(base_url: str) -> ServerLatency:
    """The server's TTFT and ITL histogram sums now (zeros where it has none)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ServerLatency()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def first(names: Sequence[str], suffix: str) -> float:
        return next((samples[n + suffix] for n in names if n + suffix in samples), 0.0)

    return ServerLatency(
        first(SERVER_TTFT, "_sum"),
        first(SERVER_TTFT, "_count"),
        first(SERVER_ITL, "_sum"),
        first(SERVER_ITL, "_count"),
    )


@dataclass
class ClientRun:
    """Medians of one client's run, its CPU per streamed token, the tokens per
    request the server reported, and the server's own latency sums over the run."""

    ttft_ms: float
    itl_ms: float  # per request, (E2E - TTFT) / (tokens - 1)
    chunk_gap_ms: float | None  # between content chunks (ours only)
    cpu_us_per_token: float | None  # None: not measured
    output_tokens: int
    prompt_tokens_per_request: float
    output_tokens_per_request: float
    server: ServerLatency


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def split_cores(
    available: set[int], server_threads: int
) -> tuple[set[int], set[int]] | None:
    """(the server's cores, the clients' cores): the server gets the highest
    `server_threads` cores and the clients the rest, so that neither client's
    processes take CPU from the server; None when there are too few cores to
    leave the clients one."""
    cores = sorted(available)
    if len(cores) <= server_threads:
        return None
    return set(cores[-server_threads:]), set(cores[:-server_threads])


@contextlib.contextmanager
def engine_server(
    model_dir: Path, threads: int, cores: set[int] | None = None
) -> Iterator[str]:
    """`python -m gpuagent.engine serve model_dir` on a free port, on `cores`
    when given (its affinity from before it starts a thread): its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "gpuagent.engine", "serve", str(model_dir)]
    cmd += ["--port", str(port), "--threads", str(threads), "--log-level", "warning"]
    cmd += ["--kv-memory-gb", "0.25"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )
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


def guidellm_like(profile: Profile, text_tokens: int, template_tokens: int) -> Profile:
    """The profile as guidellm's synthetic requests are: `text_tokens` of text plus
    the chat template around it, and no temperature (the server's default)."""
    return replace(
        profile, prompt_tokens=text_tokens + template_tokens, temperature=None
    )


async def run_ours(
    base_url: str, concurrency: int, requests: int, prompt: int, output: int
) -> ClientRun:
    """The chat profile at `concurrency` with our client, sending what guidellm
    sends (see `guidellm_like`)."""
    target = Target(base_url, await discover_model(base_url, None))
    async with new_session(60) as session:
        count = await tokenize_counter(session, base_url, target.model)
        profile = guidellm_like(
            load_profiles()["chat"].with_lengths(output_tokens=output),
            prompt,
            await count(""),
        )
        prompts = await build_prompts(profile, count)
    before = read_server_latency(base_url)
    run = await run_level(
        target, prompts, Bounds(requests, 600), concurrency=concurrency
    )
    server = read_server_latency(base_url) - before
    if run.num_errors:
        raise SystemExit(f"error: our client's run had errors: {run.errors}")
    return ClientRun(
        ttft_ms=run.ttft_ms.p50,
        itl_ms=run.tpot_ms.p50,
        chunk_gap_ms=run.itl_ms.p50,
        cpu_us_per_token=run.client_cpu_us_per_token,
        output_tokens=run.output_tokens,
        prompt_tokens_per_request=run.prompt_tokens,
        output_tokens_per_request=run.output_tokens / max(run.num_requests, 1),
        server=server,
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
    """The same load with guidellm; its CPU per token net of a run at the same
    concurrency with one request per stream (guidellm spawns a worker process per
    stream, so a one-stream run would leave most of the spawning in the net)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        before = read_server_latency(base_url)
        metrics, cpu = guidellm_once(
            base_url, tokenizer, concurrency, requests, prompt, output, folder
        )
        server = read_server_latency(base_url) - before
        base_metrics, base_cpu = guidellm_once(
            base_url, tokenizer, concurrency, concurrency, prompt, output, folder
        )
    tokens = int(metrics["output_token_count"]["successful"]["total_sum"])
    base_tokens = int(base_metrics["output_token_count"]["successful"]["total_sum"])
    return ClientRun(
        ttft_ms=metrics["time_to_first_token_ms"]["successful"]["median"],
        itl_ms=metrics["inter_token_latency_ms"]["successful"]["median"],
        chunk_gap_ms=None,
        cpu_us_per_token=(
            max(cpu - base_cpu, 0.0) * 1e6 / (tokens - base_tokens)
            if tokens > base_tokens
            else None
        ),
        output_tokens=tokens,
        prompt_tokens_per_request=metrics["prompt_token_count"]["successful"]["mean"],
        output_tokens_per_request=metrics["output_token_count"]["successful"]["mean"],
        server=server,
    )


def target_row(name: str, ours: float, theirs: float) -> str:
    """A row held to the target: both medians, their ratio and the verdict."""
    ratio = ours / theirs if theirs else float("inf")
    verdict = "PASS" if abs(ratio - 1) <= TARGET_RATIO else "FAIL"
    return f"{name:<48}{ours:>10.2f}{theirs:>10.2f}{ratio:>9.3f}  within 10%: {verdict}"


def info_row(name: str, ours: float | None, theirs: float | None) -> str:
    """A row without a target ("-" where a side has no number)."""

    def cell(value: float | None) -> str:
        return f"{value:>10.2f}" if value is not None else f"{'-':>10}"

    ratio = f"{ours / theirs:>9.3f}" if ours is not None and theirs else ""
    return f"{name:<48}{cell(ours)}{cell(theirs)}{ratio}"


def table(ours: Sequence[ClientRun], theirs: Sequence[ClientRun]) -> list[str]:
    """The comparison's rows: medians over rounds of each client's run medians, the
    server's means over all of each client's runs."""

    def median(runs: Sequence[ClientRun], field: str) -> float | None:
        values = [v for r in runs if (v := getattr(r, field)) is not None]
        return statistics.median(values) if values else None

    def server(runs: Sequence[ClientRun]) -> ServerLatency:
        return sum((r.server for r in runs), ServerLatency())

    return [
        f"{'':<48}{'ours':>10}{'guidellm':>10}{'ratio':>9}",
        target_row(
            "median TTFT, ms", median(ours, "ttft_ms"), median(theirs, "ttft_ms")
        ),
        target_row(
            "median ITL, ms: per request (E2E-TTFT)/(n-1)",
            median(ours, "itl_ms"),
            median(theirs, "itl_ms"),
        ),
        info_row(
            "median gap between content chunks, ms", median(ours, "chunk_gap_ms"), None
        ),
        info_row(
            "server's mean TTFT over the runs, ms",
            server(ours).ttft_mean_ms,
            server(theirs).ttft_mean_ms,
        ),
        info_row(
            "server's mean ITL over the runs, ms",
            server(ours).itl_mean_ms,
            server(theirs).itl_mean_ms,
        ),
        info_row(
            "prompt tokens per request (server's usage)",
            median(ours, "prompt_tokens_per_request"),
            median(theirs, "prompt_tokens_per_request"),
        ),
        info_row(
            "output tokens per request (server's usage)",
            median(ours, "output_tokens_per_request"),
            median(theirs, "output_tokens_per_request"),
        ),
        info_row(
            "client CPU per streamed token, us",
            median(ours, "cpu_us_per_token"),
            median(theirs, "cpu_us_per_token"),
        ),
    ]


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
    parser.add_argument(
        "--shared-cores",
        action="store_true",
        help="let the served engine and the clients share every core (default: "
        "the engine on its own --threads cores, the clients on the rest)",
    )
    args = parser.parse_args(argv)
    if guidellm_program() is None:
        raise SystemExit(
            "error: guidellm is not installed: `make guidellm` gives it a virtualenv "
            f"of its own ({GUIDELLM_VENV})"
        )
    tokenizer = args.tokenizer or str(args.model_dir.resolve())
    load = (args.concurrency, args.requests, args.prompt_tokens, args.output_tokens)
    split = None
    if not args.endpoint and not args.shared_cores:
        split = split_cores(os.sched_getaffinity(0), args.threads)
    server = (
        contextlib.nullcontext(args.endpoint.rstrip("/").removesuffix("/v1"))
        if args.endpoint
        else engine_server(args.model_dir, args.threads, split and split[0])
    )
    if split:  # ours runs here, guidellm's processes inherit it
        os.sched_setaffinity(0, split[1])
    cores = (
        f"engine on cores {sorted(split[0])}, clients on {sorted(split[1])}"
        if split
        else "engine and clients sharing the cores"
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

    print(
        f"chat profile, {args.prompt_tokens} prompt + {args.output_tokens} output "
        f"tokens, concurrency {args.concurrency}, {args.requests} requests x "
        f"{args.rounds} rounds, interleaved; {cores}"
    )
    print("\n".join(table(ours, theirs)))


if __name__ == "__main__":
    main()
