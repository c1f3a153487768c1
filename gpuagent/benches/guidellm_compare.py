"""Our load plan's knee and goodput against guidellm's, on one server and one
workload: `python -m gpuagent.benches.guidellm_compare [--smollm2] [--levels
1,2,4,8] [--top 256] [--rate R] [--slo-ttft-ms T --slo-tpot-ms P] [--threads 1]
[--shared-cores] [--synthetic]`.

Serves the demo model (or, with --smollm2, SmolLM2-135M from var/models/smollm2-135m)
with the project's engine once, on 127.0.0.1 (as the load_plan bench does: the
agent's KV budget), on its own --threads cores, both clients on the rest (guidellm's
processes inherit the affinity), so neither client's CPU is taken from the server;
--shared-cores lets all three share every core. Against that one server:

1. warm-up: before each level (and before the Poisson rounds, at our knee) our
   plan at that level over that level's texts, not counted, so that the server's
   prefix cache holds them for both sides as a run of that level leaves it.
   Each point sends the same texts on both sides; without it the side that ran
   first at a level met the cache as the level before left it (at c=64 on the
   demo model, whose running sequences' blocks evict cached prompts: 52% of
   prompt tokens cached) and the second as the first left it (95%), so the
   order decided the knee;
2. per level of --levels, both clients, in ABBA order (ours then guidellm at the
   first level, guidellm then ours at the next, ...) so a drift in the machine's
   load hits both alike: ours is the plan runner (`plan_runner.run_plan`) on a
   one-workload plan at that concurrency (closed loop), guidellm `guidellm run
   --profile kind=concurrent,streams=C`. The sweep stops, as a stepped plan's
   does, once both sides broke the SLO at a level; past the last of --levels it
   doubles the level while either side still meets the SLO (up to --top), so a
   knee is where the SLO broke and not the highest level run. Both sides run the
   same levels, --requests each (at least 3 per stream); the knee of each side is
   `plan_runner.knee` of its runs (the highest concurrency that met the SLO).
   Our plan runs each level and round once, as guidellm does (no retry of a run
   whose client fell behind: a retry sent new texts, uncached, and the retried
   run was the one reported; such a run is shown and makes its ratio
   INCONCLUSIVE);
3. --rate-rounds of open-loop Poisson arrivals at --rate (default --rate-fraction
   x our request throughput at our knee), both clients in the same ABBA order
   (guidellm `--profile kind=poisson,rate=R`); goodput is requests/s that met
   the SLO, first sent to last answered, the mean over the rounds. Each round
   draws its arrivals from a seed of its own on each side (our plan --seed + r,
   guidellm's `--seed` 42 + r): the two clients draw different Poisson sample
   paths (numpy's and Python's generators), and where every request meets the
   SLO the goodput is about the path's realized rate (requests / its span), which
   for 48 requests is off the asked rate by ~15% (1/sqrt(47)) either way. The same
   path every round (both seeds fixed, as before) made a fixed bias of the
   ratio (at 16.95/s: ours 13.8/s realized, guidellm's 20.6/s: ratio 0.70 with
   every request met); rounds of their own seeds average it out.

The requests are the same on both sides: the texts our plan runner sends (its
prompts calibrated to --prompt-tokens of text plus the server's chat template, the
same request tags at every point), which guidellm reads from a JSONL file
(`prompt`, `output_tokens_count`); --synthetic has guidellm generate its synthetic
text while it runs instead (random text, never in the server's prefix cache,
built by its main process on the client's core). --output-tokens answers with EOS
ignored, no temperature (guidellm sends none, so ours sends none). guidellm's
bodies differ in form only: the text as a list of parts, max_completion_tokens,
and `continuous_usage_stats` (usage in every chunk: a few % more server CPU).
guidellm's numbers are not its summaries: its per-request timestamps are read
into our LoadRun (`gpuagent.loadtest.guidellm_results`) and judged by our SLO,
knee and goodput definitions.

Printed: per point, TTFT p50/p99, TPOT p50/p99, request and output-token
throughput and the SLO verdict, ours beside guidellm's ("!": that client fell
behind); per point the server's own view (engine steps and their mean batch, and
the prefix cache's hit rate, from /metrics) and the load average; the server's
prompt and output tokens per request for each side; then the knee and goodput
ratios held to 10%. A ratio is INCONCLUSIVE, not PASS or FAIL, when its
measurement is in doubt: a client fell behind (guidellm sent a Poisson request
past our schedule limit after its target, `metrics.MAX_SCHEDULE_LAG_MS`; ours
did, or its event loop lagged) in a round, or at a level up to where its SLO
broke; or a side met the SLO at every level run (its knee only a lower bound).
Exit status: how many ratios did not pass.

guidellm is not a dependency of the project: it lives in its own virtualenv
(`make guidellm` makes var/guidellm-venv; --guidellm or $GUIDELLM names another
program); without it the bench says so and exits 2. It runs offline (the tokenizer
is the served folder) with GUIDELLM__MAX_WORKER_PROCESSES=--guidellm-workers
(default 1): our client is one process too, the machine has few cores, and guidellm
0.8.1 seeds each worker process's Poisson generator alike (`random.Random(42)` per
process), so with several workers the "Poisson" gaps repeat (6 requests at 4/s came
0.255 s apart, the seed's first draw); one worker draws one Poisson process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches.load_plan import SMOLLM2_DIR, free_port, start_server
from gpuagent.loadtest.client import new_session
from gpuagent.loadtest.compare import ServerLatency, read_server_latency, split_cores
from gpuagent.loadtest.guidellm_results import GuidellmReportError, runs_of
from gpuagent.loadtest.plan_runner import LEVEL_INDEX_STRIDE, knee, run_plan
from gpuagent.loadtest.prompts import tokenize_counter
from gpuagent.loadtest.server_metrics import (
    parse_metrics,
    prefix_cache_hit_rate,
    running_steps,
)
from gpuagent.loadtest.sessions import SessionPrompts, build_session_prompts
from gpuagent.protocol import (
    ConcurrencySweep,
    Lengths,
    LoadPlan,
    LoadRun,
    RateSweep,
    Sweeps,
    WorkloadPlan,
)

TARGET = 0.10
# guidellm's default seed; Poisson round r of the bench uses GUIDELLM_SEED + r (and
# our plan --seed + r), so that the rounds' sample paths differ on both sides
GUIDELLM_SEED = 42
GUIDELLM_VENV = Path("var/guidellm-venv")
GUIDELLM_TIMEOUT_S = 600
INSTALL_HINT = "make guidellm (a virtualenv of its own in var/guidellm-venv)"


class GuidellmUnavailable(RuntimeError):
    """guidellm can't be found or run; the message says why, with its error."""


def guidellm_program(explicit: str | None) -> str:
    """The guidellm program to run: --guidellm, else $GUIDELLM, else the one in
    var/guidellm-venv; checked with `--version`."""
    chosen = explicit or os.environ.get("GUIDELLM") or GUIDELLM_VENV / "bin/guidellm"
    program = str(Path(chosen).absolute())  # guidellm runs in a folder of its own
    if not Path(program).is_file():
        raise GuidellmUnavailable(f"no guidellm at {program}; install: {INSTALL_HINT}")
    try:
        done = subprocess.run(
            [program, "--version"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuidellmUnavailable(f"{program} --version: {exc}") from None
    if done.returncode != 0:
        raise GuidellmUnavailable(
            f"{program} --version exited {done.returncode}: {done.stderr[-1500:]}"
        )
    return program


def guidellm_env(workers: int) -> dict[str, str]:
    """guidellm's environment: offline (the tokenizer is a local folder) and its
    worker processes capped."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "GUIDELLM__MAX_WORKER_PROCESSES": str(workers),
    }


def guidellm_command(
    program: str,
    base_url: str,
    tokenizer: Path,
    profile: str,
    requests: int,
    max_seconds: float,
    data: Path | tuple[int, int],
    out: Path,
    overrides: Sequence[str] = (),
    seed: int | None = None,
) -> list[str]:
    """One `guidellm run` (guidellm 0.8's CLI): `profile` is its --profile value;
    `data` a JSONL file of prompts (`data_file`) or (prompt tokens, output tokens)
    of its synthetic text; `seed` its random seed (its Poisson gaps')."""
    cmd = [program, "run", "--backend", f"kind=openai_http,target={base_url}"]
    cmd += ["--profile", profile, *overrides]
    cmd += ["--constraint", f"kind=max_requests,count={requests}"]
    cmd += ["--constraint", f"kind=max_duration,seconds={max_seconds:g}"]
    if isinstance(data, Path):
        cmd += ["--data", f"kind=json_file,path={data.resolve()}"]
    else:
        prompt_tokens, output_tokens = data
        cmd += [
            "--data",
            f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
            f"output_tokens={output_tokens}",
        ]
    cmd += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer.resolve()}"]
    if seed is not None:  # its Poisson arrivals' seed (its default: 42)
        cmd += ["--seed", f"kind=static,value={seed}"]
    cmd += ["--output", f"kind=json,path={out}", "--disable-console"]
    return cmd


def run_guidellm(cmd: list[str], out: Path, workers: int, log: Path) -> dict:
    """Run guidellm (in a folder of its own, so nothing of ours is on its path) and
    return its JSON report; GuidellmUnavailable with its error when it fails."""
    with log.open("w") as sink:
        try:
            done = subprocess.run(
                cmd,
                cwd=out.parent,
                env=guidellm_env(workers),
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=GUIDELLM_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise GuidellmUnavailable(
                f"guidellm ran past {GUIDELLM_TIMEOUT_S} s: {' '.join(cmd)}"
            ) from None
        except OSError as exc:
            raise GuidellmUnavailable(f"{cmd[0]}: {exc}") from None
    if done.returncode != 0 or not out.exists():
        raise GuidellmUnavailable(
            f"guidellm exited {done.returncode}: {log.read_text()[-2000:]}"
        )
    return json.loads(out.read_text())


async def template_tokens(base_url: str, model: str) -> int:
    """The tokens the server's chat template adds around an empty user message."""
    async with new_session(60) as session:
        count = await tokenize_counter(session, base_url, model)
        return await count("")


async def session_prompts(
    base_url: str, model: str, work: WorkloadPlan, seed: int
) -> SessionPrompts:
    """The texts our plan runner sends for `work` with `seed` (it builds them the
    same way, from the same server's token counts)."""
    async with new_session(60) as session:
        count = await tokenize_counter(session, base_url, model)
        return await build_session_prompts(work, count, seed)


def data_file(prompts: SessionPrompts, count: int, path: Path) -> Path:
    """guidellm's requests as a JSONL file of the columns its column mapper reads
    (`prompt`, `output_tokens_count`, which it sends as max_completion_tokens with
    ignore_eos): the user messages our plan runner sends at each point (its first
    level's request tags, LEVEL_INDEX_STRIDE on), so both clients send the same
    texts, equally cached by the server's prefix cache, and guidellm builds no
    prompt while it runs."""
    with path.open("w") as out:
        for index in range(count):
            text, max_tokens = prompts.user(LEVEL_INDEX_STRIDE + index)
            out.write(json.dumps({"prompt": text, "output_tokens_count": max_tokens}))
            out.write("\n")
    return path


def level_requests(requests: int, concurrency: int) -> int:
    """Requests at a closed-loop level: --requests, and at least 3 per stream so
    that a level past --requests / 3 still runs each stream more than once."""
    return max(requests, 3 * concurrency)


def next_level(
    levels: Sequence[int], ours: Sequence[LoadRun], theirs: Sequence[LoadRun], top: int
) -> int | None:
    """The next closed-loop level of the sweep, after the points run so far (the
    two lists run point by point): the next of `levels`, unless both sides broke the
    SLO at the last point (a stepped sweep stops there); past `levels`, double the
    last while either side still met the SLO there and the double is at most `top`,
    so that the knee is where the SLO broke and not the highest level run. Both
    sides are judged on the same levels."""
    done = len(ours)
    if done and not (ours[-1].meets_slo or theirs[-1].meets_slo):
        return None
    if done < len(levels):
        return levels[done]
    last = ours[-1].concurrency or levels[-1]
    return 2 * last if 2 * last <= top else None


def knee_inconclusive(
    ours: Sequence[LoadRun], theirs: Sequence[LoadRun], top: int
) -> str | None:
    """Why the knees of these closed-loop runs prove nothing, or None: a side met
    the SLO at every level run (its knee is only a lower bound), or a client fell
    behind (its run is invalid: our event loop lagged) at a level up to where
    that side's SLO first broke, so that a break may be the client's."""
    reasons = []
    for side, runs in (("ours", ours), ("guidellm", theirs)):
        broke = next((i for i, r in enumerate(runs) if not r.meets_slo), None)
        if broke is None and runs:
            reasons.append(f"{side} met the SLO up to c={top}: a lower bound")
            continue
        behind = [r.concurrency for r in runs[: (broke or 0) + 1] if not r.valid]
        if behind:
            reasons.append(f"{side} client fell behind at c={behind}")
    return "; ".join(reasons) or None


def rate_inconclusive(ours: Sequence[LoadRun], theirs: Sequence[LoadRun]) -> str | None:
    """Why open-loop goodputs prove nothing, or None: a client fell behind its
    arrival schedule (or, ours, its event loop lagged) in a round, so it sent a
    different load than asked and measured late."""
    reasons = []
    for side, runs in (("ours", ours), ("guidellm", theirs)):
        for run in runs:
            if not run.valid:
                reasons.append(
                    f"{side} client fell behind (sent up to "
                    f"{run.max_schedule_lag_ms:.0f} ms late, loop lag p99 "
                    f"{run.loop_lag_p99_ms:.0f} ms)"
                )
    return "; ".join(reasons) or None


def workload(args, prompt_tokens: int) -> WorkloadPlan:
    """The compared workload as our plan's: fixed lengths, one turn, no shared
    system prompt, no temperature (as guidellm sends)."""
    return WorkloadPlan(
        name="compare",
        task="chat",
        language="en",
        prompt=Lengths(tokens=prompt_tokens),
        output=Lengths(tokens=args.output_tokens),
        slo_ttft_p99_ms=args.slo_ttft_ms,
        slo_tpot_p99_ms=args.slo_tpot_ms,
        temperature=None,
    )


def sweep_plan(
    args, work: WorkloadPlan, concurrency: int, requests: int | None = None
) -> LoadPlan:
    """Our closed loop at `concurrency`: `requests` (default: the level's)."""
    return LoadPlan(
        workloads=[work],
        sweeps=Sweeps(
            concurrency=ConcurrencySweep(
                mode="stepped",
                levels=[concurrency],
                requests_per_level=requests
                or level_requests(args.requests, concurrency),
                max_seconds_per_level=args.max_seconds,
                retries=0,  # guidellm runs a level once: a lagging run is shown
            ),
            context=None,
            rates=None,
        ),
        budget_s=args.max_seconds * 3,
        seed=args.seed,
    )


def rate_plan(args, work: WorkloadPlan, rate: float, seed: int) -> LoadPlan:
    return LoadPlan(
        workloads=[work],
        sweeps=Sweeps(
            concurrency=None,
            context=None,
            rates=RateSweep(
                rates=[rate],
                requests_per_level=args.rate_requests,
                max_seconds_per_level=args.max_seconds,
                retries=0,
            ),
        ),
        budget_s=args.max_seconds * 3,
        seed=seed,
    )


def ratio_row(
    name: str,
    ours: float | None,
    theirs: float | None,
    inconclusive: str | None = None,
) -> tuple[str, str]:
    """A row held to the target and its verdict, PASS, FAIL or INCONCLUSIVE. No
    number, or nothing to divide by, is no evidence: FAIL, saying so (both sides
    at nothing agree, but prove nothing). A row whose measurement is in doubt
    (`inconclusive` says why: a client fell behind, a knee only a lower bound) is
    INCONCLUSIVE whatever its ratio, which is still shown."""
    if ours is None or theirs is None or theirs == 0:
        why = "no evidence" if not (ours or theirs) else "one side at 0 or none"
        verdict = f"INCONCLUSIVE: {inconclusive}" if inconclusive else "FAIL"
        row = f"{name:<44}{_cell(ours)}{_cell(theirs)}{'-':>9}  {verdict} ({why})"
        return row, verdict.split(":")[0]
    ratio = ours / theirs
    verdict = "PASS" if abs(ratio - 1) <= TARGET else "FAIL"
    if inconclusive:
        verdict = f"INCONCLUSIVE: {inconclusive}"
    row = f"{name:<44}{_cell(ours)}{_cell(theirs)}{ratio:>9.3f}  {verdict}"
    return row, verdict.split(":")[0]


def _cell(value: float | None, width: int = 10) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"


def level_rows(ours: Sequence[LoadRun], theirs: Sequence[LoadRun]) -> list[str]:
    """Per point (the two lists run point by point, in order), ours / guidellm's:
    TTFT p50 and p99, TPOT p50 and p99 (ms), requests/s, output tokens/s, whether
    the point met the SLO ("!": the client fell behind, the run is invalid)."""
    header = (
        f"{'level':<16}{'TTFT p50':>17}{'TTFT p99':>17}{'TPOT p50':>15}"
        f"{'TPOT p99':>15}{'req/s':>13}{'out tok/s':>15}{'SLO':>9}"
    )
    rows = [header, f"{'':<16}{'ours / guidellm (ms, ms, ms, ms, /s, /s, met)':>101}"]
    for run, other in zip(ours, theirs, strict=True):
        label = (
            f"c={run.concurrency}"
            if run.concurrency
            else f"poisson {run.request_rate:g}/s"
        )

        def pair(get, width: int, digits: int = 1, run=run, other=other) -> str:
            a = f"{get(run):.{digits}f}"
            b = f"{get(other):.{digits}f}" if other else "-"
            return f" {a + ' / ' + b:>{width - 1}}"  # a space even when full

        def met(r: LoadRun | None) -> str:
            if r is None:
                return "-"
            return ("Y" if r.meets_slo else "N") + ("" if r.valid else "!")

        rows.append(
            f"{label:<16}"
            + pair(lambda r: r.ttft_ms.p50, 17)
            + pair(lambda r: r.ttft_ms.p99, 17)
            + pair(lambda r: r.tpot_ms.p50, 15, 2)
            + pair(lambda r: r.tpot_ms.p99, 15, 2)
            + pair(lambda r: r.request_throughput, 13, 2)
            + pair(lambda r: r.output_tokens_per_s, 15)
            + f"{met(run) + ' / ' + met(other):>9}"
        )
    return rows


def detail_rows(ours: Sequence[LoadRun], theirs: Sequence[LoadRun]) -> list[str]:
    """What each side sent, as the server counted it, and each run's errors."""

    def mean(runs: Sequence[LoadRun], field: str) -> float | None:
        values = [getattr(r, field) for r in runs if r.num_requests]
        return sum(values) / len(values) if values else None

    def out_per_request(runs: Sequence[LoadRun]) -> float | None:
        n = sum(r.num_requests for r in runs)
        return sum(r.output_tokens for r in runs) / n if n else None

    rows = [
        f"{'':<44}{'ours':>10}{'guidellm':>10}",
        f"{'prompt tokens per request (server usage)':<44}"
        f"{_cell(mean(ours, 'prompt_tokens'))}{_cell(mean(theirs, 'prompt_tokens'))}",
        f"{'output tokens per request (server usage)':<44}"
        f"{_cell(out_per_request(ours))}{_cell(out_per_request(theirs))}",
        f"{'requests measured / errors':<44}"
        f"{sum(r.num_requests for r in ours):>6} / {sum(r.num_errors for r in ours):<2}"
        f"{sum(r.num_requests for r in theirs):>6} / "
        f"{sum(r.num_errors for r in theirs):<2}",
    ]
    for side, runs in (("ours", ours), ("guidellm", theirs)):
        for run in runs:
            if run.request_rate is not None:
                good = round(run.goodput * run.duration_s)
                rows.append(
                    f"  {side} Poisson {run.request_rate:g}/s: {good} of "
                    f"{run.num_requests + run.num_errors} requests met the SLO in "
                    f"{run.duration_s:.1f} s (first sent -> last answered)"
                )
            if run.errors:
                rows.append(f"  {side} errors: {run.errors}")
            if not run.valid:
                rows.append(
                    f"  {side} c={run.concurrency} rate={run.request_rate}: invalid "
                    f"(schedule lag {run.max_schedule_lag_ms:.0f} ms, loop lag p99 "
                    f"{run.loop_lag_p99_ms:.0f} ms)"
                )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuagent.benches.guidellm_compare")
    parser.add_argument("--smollm2", action="store_true", help=f"serve {SMOLLM2_DIR}")
    parser.add_argument("--model-dir", type=Path, help="serve this folder instead")
    parser.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4, 8],
        help="closed-loop concurrencies, increasing (default 1,2,4,8); past the "
        "last the sweep doubles while either side meets the SLO, up to --top",
    )
    parser.add_argument(
        "--top", type=int, default=256, help="the highest level a sweep doubles to"
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="guidellm generates its synthetic text while it runs (default: it "
        "reads our texts from a JSONL file)",
    )
    parser.add_argument("--rate", type=float, help="Poisson requests/s (default: auto)")
    parser.add_argument("--requests", type=int, default=24, help="per level")
    parser.add_argument("--rate-requests", type=int, default=96, help="per round")
    parser.add_argument(
        "--rate-rounds", type=int, default=4, help="each with its own seeds"
    )
    parser.add_argument(
        "--rate-fraction",
        type=float,
        default=0.6,
        help="without --rate: this x our request throughput at our knee",
    )
    parser.add_argument("--max-seconds", type=float, default=40.0, help="per level")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="of text")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0, help="p99")
    parser.add_argument("--slo-tpot-ms", type=float, default=60.0, help="p99")
    parser.add_argument("--threads", type=int, default=1, help="the engine's")
    parser.add_argument(
        "--shared-cores",
        action="store_true",
        help="let the engine and both clients share every core (default: the "
        "engine on its own --threads cores, the clients on the rest)",
    )
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--guidellm", help="guidellm program (default: var/guidellm-venv)"
    )
    parser.add_argument("--guidellm-workers", type=int, default=1)
    parser.add_argument(
        "--keep", type=Path, help="copy guidellm's JSON reports into this folder"
    )
    args = parser.parse_args(argv)
    if args.levels != sorted(set(args.levels)) or args.levels[0] < 1:
        parser.error("--levels must be increasing concurrencies of at least 1")
    if args.top < args.levels[-1]:
        parser.error("--top must be at least the highest of --levels")
    model_dir = args.model_dir or (SMOLLM2_DIR if args.smollm2 else DEMO_MODEL_DIR)
    if not (model_dir / "config.json").is_file():
        parser.error(f"{model_dir} has no model (make real-model builds SmolLM2)")
    try:
        program = guidellm_program(args.guidellm)
    except GuidellmUnavailable as exc:
        print(f"guidellm unavailable, nothing compared: {exc}", file=sys.stderr)
        return 2

    split = None
    if not args.shared_cores:
        split = split_cores(os.sched_getaffinity(0), args.threads)
        if split is None:
            print("too few cores to give the clients their own: sharing them")
    started = time.perf_counter()
    log = tempfile.TemporaryFile("w+")
    process, base = start_server(
        model_dir,
        args.kv_cache_dtype,
        args.threads,
        free_port(),
        log,
        cores=split and split[0],
    )
    if split:  # ours runs in this process; guidellm's processes inherit it
        os.sched_setaffinity(0, split[1])
    args.cores = (
        f"engine on cores {sorted(split[0])}, both clients on {sorted(split[1])}"
        if split
        else "engine and clients sharing the cores"
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            result = compare(args, base, model_dir, program, folder)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for report in folder.glob("*.json"):
                    (args.keep / report.name).write_bytes(report.read_bytes())
    except GuidellmUnavailable as exc:
        print(f"guidellm failed, nothing compared: {exc}", file=sys.stderr)
        return 2
    except GuidellmReportError as exc:
        print(f"guidellm's report could not be read: {exc}", file=sys.stderr)
        return 2
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return result


class Sides:
    """Runs one level on each side against the server at `base`."""

    def __init__(self, args, base: str, model_dir: Path, program: str, folder: Path):
        self.args, self.base, self.model_dir = args, base, model_dir
        self.program, self.folder = program, folder
        self.model = "bench"
        self.template = asyncio.run(template_tokens(base, self.model))
        self.work = workload(args, args.prompt_tokens + self.template)
        self.data: Path | tuple[int, int] = (args.prompt_tokens, args.output_tokens)
        # the most requests any point sends: every text either side may send
        self.most = max(args.rate_requests, level_requests(args.requests, args.top))
        if not args.synthetic:
            prompts = asyncio.run(
                session_prompts(base, self.model, self.work, args.seed)
            )
            self.data = data_file(prompts, self.most, folder / "prompts.jsonl")
        self.reports = 0
        # CPU seconds of each guidellm run's processes (start-up included), on the
        # clients' cores: what it takes from our client there, or from the server
        # with --shared-cores
        self.guidellm_cpu: list[float] = []
        # the server's own TTFT and ITL histograms over each side's runs
        self.server = {"ours": ServerLatency(), "guidellm": ServerLatency()}
        # per run, in order: (engine steps, mean running sequences) or None, and
        # the prefix cache's hit rate (prompt tokens it served) or None
        self.steps: dict[str, list[tuple[int, float] | None]] = {
            "ours": [],
            "guidellm": [],
        }
        self.hits: dict[str, list[float | None]] = {"ours": [], "guidellm": []}

    def _timed(self, side: str, run):
        before, steps_before = read_server_latency(self.base), self._snapshot()
        result = run()
        self.server[side] += read_server_latency(self.base) - before
        after = self._snapshot()
        self.steps[side].append(running_steps(steps_before, after))
        self.hits[side].append(prefix_cache_hit_rate(steps_before, after))
        return result

    def _snapshot(self):
        return parse_metrics(httpx.get(f"{self.base}/metrics", timeout=30).text)

    def ours(
        self, concurrency: int | None = None, rate: float | None = None, rnd: int = 0
    ):
        return self._timed("ours", lambda: self._ours(concurrency, rate, rnd))

    def guidellm(
        self, concurrency: int | None = None, rate: float | None = None, rnd: int = 0
    ):
        return self._timed("guidellm", lambda: self._guidellm(concurrency, rate, rnd))

    def warm_level(self, concurrency: int, requests: int) -> None:
        """Our closed loop at `concurrency` over `requests` texts, not counted:
        the server's prefix cache as a run at that level leaves it, for
        whichever side runs first."""
        plan = sweep_plan(self.args, self.work, concurrency, requests)
        asyncio.run(run_plan(self.base, plan, model=self.model))

    def _ours(self, concurrency: int | None, rate: float | None, rnd: int = 0):
        """Our run; Poisson round `rnd` draws its arrivals from its own seed."""
        plan = (
            sweep_plan(self.args, self.work, concurrency)
            if concurrency
            else rate_plan(self.args, self.work, rate, self.args.seed + rnd)
        )
        report = asyncio.run(run_plan(self.base, plan, model=self.model))
        runs = report.workloads[0].runs if report.workloads else []
        if not runs:
            raise SystemExit(f"our plan measured nothing: {report.skipped_for_budget}")
        return runs[0]

    def _guidellm(self, concurrency: int | None, rate: float | None, rnd: int = 0):
        """guidellm's run; Poisson round `rnd` draws its arrivals from seed
        GUIDELLM_SEED + rnd."""
        self.reports += 1
        kind = "concurrent" if concurrency else "poisson"
        out = self.folder / f"guidellm-{self.reports:02d}-{kind}.json"
        profile = (
            f"kind=concurrent,streams={concurrency}"
            if concurrency
            else f"kind=poisson,rate={rate:g}"
        )
        args = self.args
        cmd = guidellm_command(
            self.program,
            self.base,
            self.model_dir,
            profile,
            level_requests(args.requests, concurrency)
            if concurrency
            else args.rate_requests,
            args.max_seconds,
            self.data,
            out,
            seed=None if concurrency else GUIDELLM_SEED + rnd,
        )
        log = out.with_suffix(".log")
        before = os.times()
        report = run_guidellm(cmd, out, args.guidellm_workers, log)
        after = os.times()
        self.guidellm_cpu.append(
            after.children_user
            + after.children_system
            - before.children_user
            - before.children_system
        )
        return runs_of(report, args.slo_ttft_ms, args.slo_tpot_ms)[0]


def alternate(index: int, first, second):
    """Both sides' runs of one point, in ABBA order (ours first at even points),
    so that a drift in the shared machine's load hits both alike: (ours, theirs)."""
    if index % 2 == 0:
        return first(), second()
    theirs = second()
    return first(), theirs


def load_average() -> str:
    return "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def closed_sweep(args, sides, step) -> tuple[list[LoadRun], list[LoadRun], list[float]]:
    """The closed-loop levels (`next_level`), each warmed at its own level (not
    counted) and then run by both sides in ABBA order: (ours, guidellm's, the
    load average after each level)."""
    ours_closed: list[LoadRun] = []
    theirs_closed: list[LoadRun] = []
    loads: list[float] = []
    while c := next_level(args.levels, ours_closed, theirs_closed, args.top):
        i = len(ours_closed)
        step(f"c={c}: warm-up at c={c}, not counted")
        sides.warm_level(c, level_requests(args.requests, c))
        step(f"c={c}: {'ours, guidellm' if i % 2 == 0 else 'guidellm, ours'}")
        ours, theirs = alternate(
            i, lambda c=c: sides.ours(concurrency=c), lambda c=c: sides.guidellm(c)
        )
        ours_closed.append(ours)
        theirs_closed.append(theirs)
        loads.append(os.getloadavg()[0])
    return ours_closed, theirs_closed, loads


def compare(args, base: str, model_dir: Path, program: str, folder: Path) -> int:
    def step(text: str) -> None:
        print(
            f"[{time.strftime('%H:%M:%S')}] {text} ({load_average()})",
            file=sys.stderr,
            flush=True,
        )

    sides = Sides(args, base, model_dir, program, folder)
    ours_closed, theirs_closed, loads = closed_sweep(args, sides, step)
    top = ours_closed[-1].concurrency or args.levels[-1]

    our_knee, their_knee = knee(ours_closed), knee(theirs_closed)
    at_knee = next((r for r in ours_closed if r.concurrency == our_knee), None)
    rate = args.rate or round(
        args.rate_fraction * (at_knee or ours_closed[0]).request_throughput, 2
    )
    ours_open: list[LoadRun] = []
    theirs_open: list[LoadRun] = []
    warm = our_knee or ours_closed[0].concurrency or args.levels[0]
    step(f"Poisson: warm-up at c={warm} over {args.rate_requests} texts, not counted")
    sides.warm_level(warm, args.rate_requests)
    for r in range(args.rate_rounds):
        index = len(ours_closed) + r
        step(f"Poisson {rate:g}/s round {r + 1}: ours and guidellm")
        ours, theirs = alternate(
            index,
            lambda r=r: sides.ours(rate=rate, rnd=r),
            lambda r=r: sides.guidellm(rate=rate, rnd=r),
        )
        ours_open.append(ours)
        theirs_open.append(theirs)
        loads.append(os.getloadavg()[0])

    data = (
        "guidellm's synthetic text"
        if args.synthetic
        else "the same texts on both sides (guidellm's from a JSONL file)"
    )
    print(
        f"{model_dir.name}, one engine server ({args.threads} threads, KV "
        f"{args.kv_cache_dtype}) on 127.0.0.1 ({args.cores}); "
        f"{args.prompt_tokens} prompt tokens of text (+{sides.template} of chat "
        f"template), {data}, and {args.output_tokens} output tokens; SLO TTFT p99 "
        f"<= {args.slo_ttft_ms:g} ms, TPOT p99 <= "
        f"{args.slo_tpot_ms:g} ms; {args.requests} requests per level (at least 3 "
        f"per stream), {args.rate_requests} per Poisson round; each point warmed "
        "at its level (not counted), then run by both, in ABBA order; guidellm "
        f"with {args.guidellm_workers} worker process(es), its requests judged by "
        "our SLO"
    )
    ours_all, theirs_all = [*ours_closed, *ours_open], [*theirs_closed, *theirs_open]
    print("\n".join(level_rows(ours_all, theirs_all)))
    print("\n".join(server_rows(ours_all, sides.steps, sides.hits, loads)))
    print("\n".join(detail_rows(ours_all, theirs_all)))
    ours_server, their_server = sides.server["ours"], sides.server["guidellm"]
    print(
        f"{'server mean TTFT over the runs, ms (/metrics)':<44}"
        f"{_cell(ours_server.ttft_mean_ms)}{_cell(their_server.ttft_mean_ms)}"
    )
    print(
        f"{'server mean ITL over the runs, ms (/metrics)':<44}"
        f"{_cell(ours_server.itl_mean_ms)}{_cell(their_server.itl_mean_ms)}"
    )
    print(f"{'':<44}{'ours':>10}{'guidellm':>10}{'ratio':>9}  within 10%")
    knee_row, knee_verdict = ratio_row(
        "knee: max concurrency at the SLO",
        our_knee,
        their_knee,
        knee_inconclusive(ours_closed, theirs_closed, top),
    )

    def mean_goodput(runs: Sequence[LoadRun]) -> float | None:
        return sum(r.goodput for r in runs) / len(runs) if runs else None

    good_row, good_verdict = ratio_row(
        f"goodput at {rate:g}/s Poisson (mean of {args.rate_rounds}), req/s",
        mean_goodput(ours_open),
        mean_goodput(theirs_open),
        rate_inconclusive(ours_open, theirs_open),
    )
    print(knee_row)
    print(good_row)
    cpu = ", ".join(f"{c:.1f}" for c in sides.guidellm_cpu)
    print(f"guidellm CPU per run, s (its processes, start-up included): {cpu}")
    print(load_average())
    return (knee_verdict != "PASS") + (good_verdict != "PASS")


def server_rows(
    ours: Sequence[LoadRun],
    steps: dict[str, list[tuple[int, float] | None]],
    hits: dict[str, list[float | None]],
    loads: Sequence[float],
) -> list[str]:
    """Per point, from the server's /metrics: the engine steps each side's run
    took and their mean running sequences (the same requests in fewer, bigger
    steps queued up together), the share of prompt tokens its prefix cache
    served; and the machine's 1-minute load average after the point."""
    header = "server steps, mean batch: ours / guidellm"
    rows = [f"{'level':<16}{header:>46}{'prefix cache hits':>22}{'load':>8}"]

    def cell(value: tuple[int, float] | None) -> str:
        return f"{value[0]}, {value[1]:.1f}" if value else "-"

    def rate(value: float | None) -> str:
        return f"{value:.0%}" if value is not None else "-"

    for run, a, b, ha, hb, load in zip(
        ours,
        steps["ours"],
        steps["guidellm"],
        hits["ours"],
        hits["guidellm"],
        loads,
        strict=True,
    ):
        label = (
            f"c={run.concurrency}"
            if run.concurrency
            else f"poisson {run.request_rate:g}/s"
        )
        rows.append(
            f"{label:<16}{cell(a) + ' / ' + cell(b):>46}"
            f"{rate(ha) + ' / ' + rate(hb):>22}{load:>8.1f}"
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
