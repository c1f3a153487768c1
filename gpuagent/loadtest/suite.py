"""A load test of one endpoint over several workload profiles under the same plan,
returning the `LoadTestReport` the gates read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from gpuagent.loadtest.client import RequestRecord, new_session
from gpuagent.loadtest.profiles import Profile
from gpuagent.loadtest.prompts import build_prompts, tokenize_counter
from gpuagent.loadtest.runner import (
    Bounds,
    Costs,
    Target,
    concurrency_levels,
    run_level,
    saturated,
    workload_report,
)
from gpuagent.loadtest.server_metrics import ServerSnapshot, read_metrics
from gpuagent.protocol import LoadRun, LoadTestReport, WorkloadReport


class LoadTestError(RuntimeError):
    """The load test can't run against this endpoint; the message says why."""


@dataclass
class Plan:
    """What load to apply to every profile."""

    concurrency: Sequence[int] = ()  # fixed levels; empty: a sweep to saturation
    max_concurrency: int = 64  # the sweep's ceiling
    rates: Sequence[float] = ()  # open-loop levels (requests/s)
    burstiness: float | None = None  # gamma shape for open loop; None: Poisson
    context_sweep: bool = False  # profiles with context_sweep lengths sweep them
    context_sweep_concurrency: int = 4
    bounds: Bounds = field(default_factory=Bounds)
    seed: int = 0


Progress = Callable[[str, int, int], None]  # (label, done, total)


async def discover_model(base_url: str, model: str | None) -> str:
    """The model to load: `model`, or the first /v1/models lists."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        try:
            async with s.get(f"{base_url}/v1/models") as resp:
                if resp.status != 200:
                    raise LoadTestError(f"{base_url}/v1/models answered {resp.status}")
                cards = (await resp.json())["data"]
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise LoadTestError(f"{base_url} is not reachable: {exc}") from None
    names = [c["id"] for c in cards]
    if model is not None and model not in names:
        raise LoadTestError(f"{base_url} does not serve {model!r}; it serves {names}")
    if not names:
        raise LoadTestError(f"{base_url} serves no model")
    return model or names[0]


async def run_profile(
    target: Target,
    profile: Profile,
    plan: Plan,
    server: ServerSnapshot,
    costs: Costs,
    progress: Progress,
) -> WorkloadReport:
    """Every level of the plan for one profile (and its context sweep)."""
    if server.max_model_len and profile.context_tokens > server.max_model_len:
        raise LoadTestError(
            f"profile {profile.name!r} needs {profile.context_tokens} tokens per "
            f"session; the server holds {server.max_model_len}"
        )
    async with new_session(target.timeout_s) as session:
        count = await tokenize_counter(session, target.base_url, target.model)
        prompts = await build_prompts(profile, count)

    async def level(label: str, prompt_set=prompts, **kwargs) -> LoadRun:
        done = 0
        total = plan.bounds.requests

        def tick(_: RequestRecord) -> None:
            nonlocal done
            done += 1
            progress(label, done, total)

        progress(label, 0, total)
        return await run_level(
            target, prompt_set, plan.bounds, seed=plan.seed, on_done=tick, **kwargs
        )

    runs: list[LoadRun] = []
    closed = plan.concurrency or concurrency_levels(plan.max_concurrency)
    for c in closed:
        runs.append(await level(f"{profile.name} c={c}", concurrency=c))
        if not plan.concurrency and saturated(runs):
            break
    for rate in plan.rates:
        runs.append(
            await level(
                f"{profile.name} {rate}/s", rate=rate, burstiness=plan.burstiness
            )
        )
    sweep: list[LoadRun] = []
    if plan.context_sweep:
        for tokens in profile.context_sweep:
            longer = profile.with_lengths(prompt_tokens=tokens)
            if server.max_model_len and longer.context_tokens > server.max_model_len:
                continue  # the server can't hold it: not a load level
            async with new_session(target.timeout_s) as session:
                count = await tokenize_counter(session, target.base_url, target.model)
                longer_prompts = await build_prompts(longer, count)
            run = await level(
                f"{profile.name} {tokens} tok",
                prompt_set=longer_prompts,
                concurrency=plan.context_sweep_concurrency,
            )
            sweep.append(run)
    return workload_report(profile, runs, server, costs, sweep)


async def run_load_test(
    base_url: str,
    profiles: Sequence[Profile],
    plan: Plan,
    costs: Costs,
    model: str | None = None,
    progress: Progress = lambda *_: None,
    timeout_s: float = 600.0,
) -> LoadTestReport:
    """Every profile under the same plan against `base_url`."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    target = Target(base_url, await discover_model(base_url, model), timeout_s)
    async with new_session(30.0) as session:
        server = await read_metrics(session, base_url)
    workloads = [
        await run_profile(target, profile, plan, server, costs, progress)
        for profile in profiles
    ]
    return LoadTestReport(
        endpoint=base_url,
        gpu_hourly_usd=costs.gpu_hourly_usd,
        gpu_count=costs.gpu_count,
        weights_bytes=server.weights_bytes,
        kv_budget_bytes=server.kv_cache_bytes,
        kv_bytes_per_token=server.kv_bytes_per_token,
        kv_cache_dtype=server.kv_cache_dtype,
        workloads=workloads,
        model=target.model,
        kv_blocks_total=server.kv_blocks_total,
        kv_block_size_tokens=server.kv_block_size_tokens,
        max_model_len=server.max_model_len,
    )
