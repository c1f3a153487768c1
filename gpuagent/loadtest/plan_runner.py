"""A load-test plan (`gpuagent.protocol.LoadPlan`) run against one endpoint, within
its time budget, to the `LoadTestReport` the gates read.

For each workload, in the plan's order, with a fair share of the budget left (the
time left over divided by the workloads left, so one slow workload can't starve the
rest; what a workload leaves unused goes to the next):

- the concurrency sweep (closed loop): `stepped` runs its levels until the SLO
  breaks; `search` doubles from 1 until it breaks (or max_concurrency), then bisects
  between the last level that met it and the first that didn't. The knee is the
  highest concurrency that met the SLO; every level run is the curve.
- the rate sweep (open loop): each rate once.
- a level whose client fell behind (its schedule, or its event loop:
  `metrics.ClientHealth.kept_up`) is invalid, says so, and is run again (up to the
  sweep's `retries`) while the budget lasts, the report counting the retries: a
  busy client is no evidence that the server broke its SLO.
- the context sweep: single requests of each context length (prompt + answer) at
  one concurrency; a length over the server's max_model_len is skipped, named.

A level gets at most the budget left (`cut_by_budget` when that ended it early; a
request still in flight at the budget's end is stopped, and left out of the
numbers); one that can't start with MIN_LEVEL_S left is skipped and named in
`skipped_for_budget`, as is every level a sweep would still have run.

Per level, beside the latency percentiles, throughput and goodput: the prefix-cache
hit rate as the server counted it on /metrics (else its usage cached_tokens, else
None: never assumed), what the session model implies (`sessions.
implied_cached_tokens`), and the peak of KV blocks in use from /metrics samples.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuagent.loadtest.client import RequestRecord, new_session
from gpuagent.loadtest.metrics import ClientHealth, load_run
from gpuagent.loadtest.prompts import PromptError, tokenize_counter
from gpuagent.loadtest.runner import Costs, LoopLagProbe, Target, workload_report
from gpuagent.loadtest.server_metrics import (
    ServerSnapshot,
    peak_running,
    prefix_cache_hit_rate,
    read_metrics,
)
from gpuagent.loadtest.sessions import (
    LevelRecords,
    SessionPrompts,
    build_session_prompts,
    implied_cached_tokens,
    opening_tokens,
    profile_of,
    run_sessions,
)
from gpuagent.loadtest.suite import discover_model
from gpuagent.protocol import (
    Lengths,
    LoadPlan,
    LoadRun,
    LoadTestReport,
    WorkloadPlan,
    WorkloadReport,
)

MIN_LEVEL_S = 1.0  # a level that can't have this long is skipped for the budget
KV_SAMPLE_INTERVAL_S = 0.25
LEVEL_INDEX_STRIDE = 10_000  # request tags per level (6 digits: 100 levels)

Progress = Callable[[str, int, int], None]


@dataclass
class Budget:
    """The plan's deadline, and the points it left unmeasured."""

    deadline: float  # time.perf_counter()
    skipped: list[str] = field(default_factory=list)

    def left(self, until: float | None = None) -> float:
        return min(self.deadline, until or self.deadline) - time.perf_counter()

    def allows(self, label: str, until: float | None = None) -> bool:
        """Whether a level may start now; if not, it is named as skipped."""
        if self.left(until) < MIN_LEVEL_S:
            self.skipped.append(label)
            return False
        return True


class KvSampler:
    """The most KV blocks in use in /metrics samples taken during a level."""

    def __init__(self, session, base_url: str) -> None:
        self.session, self.base_url = session, base_url
        self.peak = 0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            snapshot = await read_metrics(self.session, self.base_url)
            self.peak = max(self.peak, snapshot.kv_blocks_used)
            await asyncio.sleep(KV_SAMPLE_INTERVAL_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> int:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        return self.peak


@dataclass
class PlanRun:
    """State shared by every level of one plan run."""

    target: Target
    plan: LoadPlan
    server: ServerSnapshot
    budget: Budget
    progress: Progress
    levels: int = 0
    unmeasured: list[str] = field(default_factory=list)
    # system prompts an earlier level sent: their opening is in the server's cache
    warm_openings: set[str] = field(default_factory=set)

    async def level(
        self,
        label: str,
        prompts: SessionPrompts,
        opening: int,
        *,
        requests: int,
        max_seconds: float,
        until: float,
        concurrency: int | None = None,
        rate: float | None = None,
        burstiness: float | None = None,
        turns: int | None = None,
    ) -> LoadRun:
        """One level's LoadRun, ended by its own time or the budget's."""
        workload = prompts.workload
        self.levels += 1
        own_end = time.perf_counter() + max_seconds
        deadline = min(own_end, self.budget.deadline, until)
        done = 0

        def tick(_: RequestRecord) -> None:
            nonlocal done
            done += 1
            self.progress(label, done, requests)

        self.progress(label, 0, requests)
        async with new_session(self.target.timeout_s) as session:
            before = await read_metrics(session, self.target.base_url)
            probe, sampler = LoopLagProbe(), KvSampler(session, self.target.base_url)
            probe.start()
            sampler.start()
            cpu_before = time.process_time()
            sent = await run_sessions(
                session,
                self.target.chat_url,
                self.target.model,
                prompts,
                requests=requests,
                deadline=deadline,
                concurrency=concurrency,
                rate=rate,
                burstiness=burstiness,
                seed=self.plan.seed + self.levels,
                turns=turns,
                first_index=self.levels * LEVEL_INDEX_STRIDE,
                hard_deadline=self.budget.deadline,
                on_done=tick,
            )
            cpu_s = time.process_time() - cpu_before
            loop_lag = await probe.stop()
            kv_peak = await sampler.stop()
            after = await read_metrics(session, self.target.base_url)
        records = sent.records
        warm = set(self.warm_openings)
        if records:
            self.warm_openings.add(prompts.system)
        health = ClientHealth(
            max_schedule_lag_ms=sent.max_schedule_lag_ms,
            loop_lag_p99_ms=loop_lag,
            cpu_s=cpu_s,
        )
        arrival = (
            "closed" if rate is None else ("poisson" if burstiness is None else "gamma")
        )
        run = load_run(
            records,
            workload.slo_ttft_p99_ms,
            workload.slo_tpot_p99_ms,
            health,
            concurrency=concurrency,
            request_rate=rate,
            arrival=arrival,
            preemptions=max(after.preemptions - before.preemptions, 0),
            peak_concurrent_sequences=peak_running(before, after),
        )
        return run.model_copy(
            update={
                "burstiness": burstiness,
                **cache_fields(
                    sent,
                    before,
                    after,
                    opening,
                    workload,
                    opening_cached=prompts.system in warm,
                ),
                "kv_blocks_used_peak": kv_peak,
                "kv_memory_bytes_peak": kv_peak
                * self.server.kv_block_size_tokens
                * self.server.kv_bytes_per_token,
                "cut_by_budget": sent.cut_in_flight > 0
                or (
                    sent.cut_by_deadline
                    and deadline < own_end
                    and len(records) < requests
                ),
            }
        )


def cache_fields(
    sent: LevelRecords,
    before: ServerSnapshot,
    after: ServerSnapshot,
    opening: int,
    workload: WorkloadPlan,
    opening_cached: bool = False,
) -> dict:
    """The prefix-cache numbers of one level: the server's and the plan's."""
    ok = [r for r in sent.records if r.ok]
    reported = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    fields: dict = {"cached_tokens": sum(reported) if reported else None}
    rate = prefix_cache_hit_rate(before, after)
    if rate is not None:
        fields |= {
            "prefix_cache_hit_rate": rate,
            "prefix_cache_hit_rate_source": "metrics",
        }
    elif reported and prompt_tokens:
        fields |= {
            "prefix_cache_hit_rate": min(sum(reported) / prompt_tokens, 1.0),
            "prefix_cache_hit_rate_source": "usage",
        }
    block = after.kv_block_size_tokens
    if block and prompt_tokens:
        implied = implied_cached_tokens(
            sent, opening, block, workload.session.carry_history, opening_cached
        )
        fields["implied_prefix_cache_hit_rate"] = min(sum(implied) / prompt_tokens, 1.0)
    return fields


def search_levels(met: dict[int, bool], max_concurrency: int) -> int | None:
    """The next concurrency a knee search runs, given what each level run so far
    did (True: met the SLO); None when the knee is known."""
    if not met:
        return 1
    good = [c for c, ok in met.items() if ok]
    bad = [c for c, ok in met.items() if not ok]
    low = max(good, default=0)
    high = min((c for c in bad if c > low), default=None)
    if high is None:  # nothing broke above the best level yet: double
        if low >= max_concurrency:
            return None
        return min(low * 2, max_concurrency)
    if high - low <= 1:
        return None
    return (low + high) // 2


def knee(runs: list[LoadRun]) -> int | None:
    """The highest closed-loop concurrency whose valid run met the SLO."""
    met = [r.concurrency for r in runs if r.concurrency and r.meets_slo and r.valid]
    return max(met, default=None)


async def concurrency_sweep(
    state: PlanRun, prompts: SessionPrompts, opening: int, until: float
) -> list[LoadRun]:
    sweep = state.plan.sweeps.concurrency
    name = prompts.workload.name
    runs: list[LoadRun] = []

    def requests(c: int) -> int:
        return max(sweep.requests_per_level, 2 * c)

    async def run(c: int) -> LoadRun:
        label, retries = f"{name} c={c}", 0
        while True:
            run = await state.level(
                label,
                prompts,
                opening,
                requests=requests(c),
                max_seconds=sweep.max_seconds_per_level,
                until=until,
                concurrency=c,
            )
            if run.valid or retries >= sweep.retries:
                break
            if not state.budget.allows(f"{label} (retry)", until):
                break
            retries += 1
        return run.model_copy(update={"retries": retries})

    if sweep.mode == "stepped":
        levels = list(sweep.levels) or doubling(sweep.max_concurrency)
        for i, c in enumerate(levels):
            if not state.budget.allows(f"{name} c={c}", until):
                state.budget.skipped += [f"{name} c={x}" for x in levels[i + 1 :]]
                break
            runs.append(await run(c))
            if runs[-1].valid and not runs[-1].meets_slo:
                break  # broken (a client that fell behind showed nothing)
        return runs
    met: dict[int, bool] = {}
    while (c := search_levels(met, sweep.max_concurrency)) is not None:
        if not state.budget.allows(f"{name} c={c} (knee search unfinished)", until):
            break
        runs.append(await run(c))
        met[c] = runs[-1].meets_slo and runs[-1].valid
    return sorted(runs, key=lambda r: r.concurrency or 0)


def doubling(max_concurrency: int) -> list[int]:
    levels, c = [], 1
    while c < max_concurrency:
        levels.append(c)
        c *= 2
    return [*levels, max_concurrency]


async def rate_sweep(
    state: PlanRun, prompts: SessionPrompts, opening: int, until: float
) -> list[LoadRun]:
    sweep = state.plan.sweeps.rates
    name = prompts.workload.name
    runs: list[LoadRun] = []
    for rate in sweep.rates:
        label = f"{name} {rate:g}/s"
        retries = 0
        run = None
        while state.budget.allows(label if run is None else f"{label} (retry)", until):
            run = await state.level(
                label,
                prompts,
                opening,
                requests=sweep.requests_per_level,
                max_seconds=sweep.max_seconds_per_level,
                until=until,
                rate=rate,
                burstiness=sweep.burstiness,
            )
            if run.valid or retries >= sweep.retries:
                break
            retries += 1
        if run is not None:
            runs.append(run.model_copy(update={"retries": retries}))
    return runs


async def context_sweep(
    state: PlanRun, workload: WorkloadPlan, count, until: float
) -> list[LoadRun]:
    sweep = state.plan.sweeps.context
    max_len = state.server.max_model_len
    runs: list[LoadRun] = []
    if "max_model_len" in sweep.context_tokens and not max_len:
        state.unmeasured.append(
            f"{workload.name} max_model_len tok: the server does not say its own"
        )
    lengths = sorted(
        {max_len if t == "max_model_len" else t for t in sweep.context_tokens} - {0}
    )
    for tokens in lengths:
        label = f"{workload.name} {tokens} tok"
        if max_len and tokens > max_len:
            state.unmeasured.append(f"{label}: over the server's max_model_len")
            continue
        prompt_tokens = tokens - workload.output.tokens
        if prompt_tokens < 1:
            state.unmeasured.append(f"{label}: not longer than the answer")
            continue
        if not state.budget.allows(label, until):
            continue
        prompts = await build_session_prompts(
            workload,
            count,
            state.plan.seed,
            prompt_tokens=Lengths(tokens=prompt_tokens),
            with_session=False,
        )
        prompts.output_tokens = [workload.output.tokens] * len(prompts.turns)
        if not state.budget.allows(label, until):
            continue
        run = await state.level(
            label,
            prompts,
            0,
            requests=sweep.requests_per_level,
            max_seconds=sweep.max_seconds_per_level,
            until=until,
            concurrency=sweep.concurrency,
            turns=1,
        )
        runs.append(run)
    return runs


async def run_workload(
    state: PlanRun, workload: WorkloadPlan, until: float
) -> WorkloadReport:
    target, plan = state.target, state.plan
    profile = profile_of(workload)
    runs: list[LoadRun] = []
    sweep: list[LoadRun] = []
    async with new_session(target.timeout_s) as session:
        count = await tokenize_counter(session, target.base_url, target.model)
        prompts = await build_session_prompts(workload, count, plan.seed)
        opening = await opening_tokens(session, target.base_url, target.model, prompts)
    if plan.sweep_applies("concurrency", workload.name):
        runs += await concurrency_sweep(state, prompts, opening, until)
    if plan.sweep_applies("rates", workload.name):
        runs += await rate_sweep(state, prompts, opening, until)
    if plan.sweep_applies("context", workload.name):
        async with new_session(target.timeout_s) as session:
            count = await tokenize_counter(session, target.base_url, target.model)
            sweep = await context_sweep(state, workload, count, until)
    measured = [r.prompt_tokens for r in runs if r.num_requests]
    if measured:  # a session's turns grow: report the mean prompt sent
        mean = round(sum(measured) / len(measured))
        profile = profile.with_lengths(prompt_tokens=mean)
    report = workload_report(profile, runs, state.server, Costs(), sweep)
    goodputs = [r.goodput for r in runs if r.request_rate is not None and r.valid]
    return report.model_copy(
        update={
            "knee_concurrency": knee(runs),
            "max_goodput": max(goodputs, default=None),
            "turns_per_session": workload.session.turns,
            "system_prompt_tokens": workload.session.system_prompt_tokens,
        }
    )


async def run_plan(
    base_url: str,
    plan: LoadPlan,
    model: str | None = None,
    progress: Progress = lambda *_: None,
    timeout_s: float = 600.0,
) -> LoadTestReport:
    """Every workload of `plan` against `base_url`, stopped at its budget."""
    started = time.perf_counter()
    budget = Budget(deadline=started + plan.budget_s)
    base_url = base_url.rstrip("/").removesuffix("/v1")
    target = Target(base_url, await discover_model(base_url, model), timeout_s)
    async with new_session(30.0) as session:
        server = await read_metrics(session, base_url)
    state = PlanRun(target, plan, server, budget, progress)
    workloads = []
    for i, workload in enumerate(plan.workloads):
        left = budget.left()
        if left < MIN_LEVEL_S:
            budget.skipped.append(f"{workload.name} (every point)")
            continue
        until = time.perf_counter() + left / (len(plan.workloads) - i)
        try:
            workloads.append(await run_workload(state, workload, until))
        except PromptError as exc:  # too short for its instruction on this server
            state.unmeasured.append(f"{workload.name} (every point): {exc}")
    return LoadTestReport(
        endpoint=base_url,
        gpu_hourly_usd=0.0,
        gpu_count=1,
        weights_bytes=server.weights_bytes,
        kv_budget_bytes=server.kv_cache_bytes,
        kv_bytes_per_token=server.kv_bytes_per_token,
        kv_cache_dtype=server.kv_cache_dtype,
        workloads=workloads,
        model=target.model,
        kv_blocks_total=server.kv_blocks_total,
        kv_block_size_tokens=server.kv_block_size_tokens,
        max_model_len=server.max_model_len,
        plan=plan,
        budget_s=plan.budget_s,
        wall_s=time.perf_counter() - started,
        skipped_for_budget=budget.skipped,
        unmeasured=state.unmeasured,
    )
