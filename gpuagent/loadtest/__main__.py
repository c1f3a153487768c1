"""`python -m gpuagent.loadtest --endpoint URL --profile chat [--profile rag ...]
[--sweep 1,2,4,8 | --sweep auto] [--max-concurrency 64] [--rate 2,4 [--burstiness K]]
[--context-sweep] [--requests 64] [--max-seconds 120] [--prompt-tokens N]
[--output-tokens N] [--gpu-hourly-usd 2.5 --gpu-count 1 --target-rate R]
[--profiles FILE] [--seed 0] [--json OUT]`

Runs every profile under the same load, with a progress bar on stderr; prints one
row per load level and the headline numbers at the highest load that met the SLO,
and writes the LoadTestReport as JSON. Exit status 1 with the reason when the
endpoint can't be tested (unreachable, a profile longer than it holds).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuagent.loadtest.profiles import PROFILES_FILE, ProfileError, load_profiles
from gpuagent.loadtest.prompts import PromptError
from gpuagent.loadtest.runner import Bounds, Costs
from gpuagent.loadtest.suite import LoadTestError, Plan, run_load_test
from gpuagent.protocol import LoadRun, LoadTestReport

BAR_WIDTH = 24


def numbers(text: str, kind: type) -> list:
    """A comma-separated list of `kind`."""
    return [kind(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    parser = argparse.ArgumentParser(prog="python -m gpuagent.loadtest")
    parser.add_argument("--endpoint", required=True, help="base URL of the server")
    parser.add_argument("--model", help="served model name (default: the first)")
    parser.add_argument(
        "--profile", action="append", required=True, help="profile name (repeatable)"
    )
    parser.add_argument("--profiles", type=Path, default=PROFILES_FILE)
    parser.add_argument(
        "--sweep",
        default="auto",
        help="closed-loop concurrencies, e.g. 1,4,16; 'auto' doubles until saturation",
    )
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--rate", default="", help="open-loop requests/s, e.g. 1,2")
    parser.add_argument(
        "--burstiness",
        type=float,
        help="gamma arrivals of this shape (default Poisson)",
    )
    parser.add_argument("--context-sweep", action="store_true")
    parser.add_argument("--context-sweep-concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64, help="per load level")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="per level")
    parser.add_argument("--prompt-tokens", type=int, help="override every profile's")
    parser.add_argument("--output-tokens", type=int, help="override every profile's")
    parser.add_argument("--gpu-hourly-usd", type=float, default=0.0)
    parser.add_argument("--gpu-count", type=int, default=1)
    parser.add_argument("--target-rate", type=float, help="requests/s to plan GPUs for")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument("--json", type=Path, help="write the LoadTestReport here")
    return parser


def progress_bar(label: str, done: int, total: int) -> None:
    """One redrawn line on stderr."""
    filled = BAR_WIDTH * done // max(total, 1)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    end = "\n" if done >= total else ""
    print(f"\r{label:<24} [{bar}] {done}/{total}", end=end, file=sys.stderr, flush=True)


def run_row(run: LoadRun) -> str:
    level = (
        f"c={run.concurrency}"
        if run.concurrency is not None
        else f"{run.request_rate:g}/s {run.arrival}"
    )
    flags = ("" if run.valid else " INVALID") + (" SLO" if run.meets_slo else "")
    return (
        f"  {level:<14}{run.prompt_tokens:>7}{run.num_requests:>6}{run.num_errors:>5}"
        f"{run.ttft_ms.p50:>9.1f}{run.ttft_ms.p99:>9.1f}{run.tpot_ms.p50:>8.1f}"
        f"{run.tpot_ms.p99:>8.1f}{run.itl_ms.p50:>8.1f}{run.e2e_ms.p99:>9.0f}"
        f"{run.request_throughput:>8.2f}{run.output_tokens_per_s:>9.1f}"
        f"{run.goodput:>8.2f}{run.peak_concurrent_sequences:>6}{run.preemptions:>6}"
        f"{run.client_cpu_us_per_token:>8.0f}{flags}"
    )


def render(report: LoadTestReport) -> str:
    """The report as a table: a block per workload, a row per load level."""
    lines = [
        f"{report.endpoint} ({report.model}): KV {report.kv_cache_dtype}, "
        f"{report.kv_bytes_per_token} B/token, "
        f"{report.kv_budget_bytes / 2**20:.1f} MiB KV, "
        f"{report.weights_bytes / 2**20:.1f} MiB weights, max_model_len "
        f"{report.max_model_len}",
        f"  {'level':<14}{'prompt':>7}{'ok':>6}{'err':>5}{'TTFT50':>9}{'TTFT99':>9}"
        f"{'TPOT50':>8}{'TPOT99':>8}{'ITL50':>8}{'E2E99':>9}{'req/s':>8}"
        f"{'tok/s':>9}{'good/s':>8}{'peak':>6}{'preem':>6}{'cpu/tok':>8}",
        "  (times in ms; cpu/tok: the client's own CPU per output token, us)",
    ]
    for w in report.workloads:
        lines.append(
            f"{w.profile}: {w.prompt_tokens} prompt + {w.output_tokens} output tokens, "
            f"SLO TTFT p99 <= {w.slo_ttft_p99_ms:g} ms, TPOT p99 <= "
            f"{w.slo_tpot_p99_ms:g} ms; KV holds {w.max_sessions_at_context} sessions"
        )
        lines += [run_row(r) for r in w.runs]
        if w.context_sweep:
            lines.append("  context sweep:")
            lines += [run_row(r) for r in w.context_sweep]
        if w.max_concurrency_at_slo is None and w.output_tokens_per_s_at_slo is None:
            lines.append("  no load level met the SLO")
        else:
            cost = (
                f"${w.cost_per_1m_output_tokens:.4f}/1M output tokens, "
                f"${w.cost_per_request:.6f}/request"
                if w.cost_per_1m_output_tokens is not None
                else "no GPU price given"
            )
            gpus = (
                f", {w.gpus_for_target_rate} GPUs for {w.target_request_rate:g} req/s"
                if w.gpus_for_target_rate is not None
                else ""
            )
            lines.append(
                f"  at the SLO: concurrency {w.max_concurrency_at_slo}, "
                f"{w.output_tokens_per_s_at_slo:.1f} tok/s, "
                f"{w.requests_per_gpu_hour:.0f} req/GPU-hour, {cost}{gpus}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> LoadTestReport:
    """Entry point of `python -m gpuagent.loadtest`."""
    args = build_parser().parse_args(argv)
    try:
        profiles = load_profiles(args.profiles)
    except ProfileError as exc:
        raise SystemExit(f"error: {exc}") from None
    unknown = [p for p in args.profile if p not in profiles]
    if unknown:
        raise SystemExit(f"error: unknown profiles {unknown}; known: {list(profiles)}")
    chosen = [
        profiles[p].with_lengths(args.prompt_tokens, args.output_tokens)
        for p in args.profile
    ]
    plan = Plan(
        concurrency=[] if args.sweep == "auto" else numbers(args.sweep, int),
        max_concurrency=args.max_concurrency,
        rates=numbers(args.rate, float),
        burstiness=args.burstiness,
        context_sweep=args.context_sweep,
        context_sweep_concurrency=args.context_sweep_concurrency,
        bounds=Bounds(requests=args.requests, max_seconds=args.max_seconds),
        seed=args.seed,
    )
    costs = Costs(args.gpu_hourly_usd, args.gpu_count, args.target_rate)
    try:
        report = asyncio.run(
            run_load_test(
                args.endpoint,
                chosen,
                plan,
                costs,
                model=args.model,
                progress=progress_bar,
                timeout_s=args.timeout_s,
            )
        )
    except (LoadTestError, PromptError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(render(report))
    if args.json:
        args.json.write_text(report.model_dump_json(indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
