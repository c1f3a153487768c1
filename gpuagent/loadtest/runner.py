"""Load levels against one endpoint, and a workload's report with its costs.

- Closed loop at concurrency c: c workers, each sending its next request when its
  last one ends, for `requests` requests or `max_seconds`, whichever comes first.
- Open loop at `rate` requests/s: arrival times drawn up front (Poisson, or gamma
  with a shape `burstiness`; seeded), each request sent at its time whatever is in
  flight; the lag behind that schedule is measured, and a client that fell behind
  marks the run invalid.
- A closed-loop sweep doubles the concurrency until the load saturates the server
  (request throughput gains less than SATURATION_GAIN) or the SLO fails twice in a
  row; the RAG context sweep repeats one concurrency at several prompt lengths.

Each run brackets itself with /metrics readings: the preemptions between them, and
the peak of concurrent sequences from the engine's per-step histogram
(`server_metrics.peak_running`). The client's own CPU time and event-loop lag are
measured and reported beside the numbers they could distort.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gpuagent.loadtest.client import RequestRecord, new_session, stream_chat
from gpuagent.loadtest.metrics import ClientHealth, load_run
from gpuagent.loadtest.profiles import Profile
from gpuagent.loadtest.prompts import PromptSet, messages
from gpuagent.loadtest.server_metrics import (
    ServerSnapshot,
    peak_running,
    read_metrics,
)
from gpuagent.protocol import LoadRun, WorkloadReport

SATURATION_GAIN = 0.10
LOOP_PROBE_INTERVAL_S = 0.01


@dataclass
class Target:
    """The endpoint under test."""

    base_url: str
    model: str
    timeout_s: float = 600.0

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/v1/chat/completions"


@dataclass
class Bounds:
    """How much one load level may run."""

    requests: int = 64
    max_seconds: float = 120.0


def request_body(target: Target, prompts: PromptSet, index: int) -> dict:
    """Request `index`'s body: streamed, at the profile's temperature (greedy unless
    it says otherwise), usage in the stream."""
    profile = prompts.profile
    body = {
        "model": target.model,
        "messages": messages(prompts.content(index)),
        "max_tokens": profile.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if profile.temperature is not None:
        body["temperature"] = profile.temperature
    if profile.fixed_output:
        body["ignore_eos"] = True
    return body


class LoopLagProbe:
    """How late the event loop wakes a timer: the client's own backlog."""

    def __init__(self) -> None:
        self.lags_s: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(LOOP_PROBE_INTERVAL_S)
            self.lags_s.append(time.perf_counter() - before - LOOP_PROBE_INTERVAL_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> float:
        """Stop; the p99 lag in ms."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        return float(np.percentile(self.lags_s, 99) * 1e3) if self.lags_s else 0.0


def arrival_times(
    rate: float, count: int, seed: int, burstiness: float | None = None
) -> np.ndarray:
    """Send times (s from the start) of `count` requests at `rate`/s: Poisson gaps,
    or gamma gaps of shape `burstiness` (1 is Poisson; lower is burstier)."""
    rng = np.random.default_rng(seed)
    if burstiness is None:
        gaps = rng.exponential(1.0 / rate, count)
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), count)
    return np.cumsum(gaps) - gaps[0]  # the first request at once


async def run_level(
    target: Target,
    prompts: PromptSet,
    bounds: Bounds,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    burstiness: float | None = None,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] = lambda _: None,
) -> LoadRun:
    """One load level: closed loop at `concurrency`, or open loop at `rate`."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    profile = prompts.profile
    records: list[RequestRecord] = []
    async with new_session(target.timeout_s) as session:
        before = await read_metrics(session, target.base_url)
        probe = LoopLagProbe()
        probe.start()
        cpu_before = time.process_time()
        start = time.perf_counter()
        deadline = start + bounds.max_seconds

        async def one(index: int, scheduled_s: float) -> None:
            record = RequestRecord(scheduled_s=scheduled_s)
            records.append(record)
            await stream_chat(
                session, target.chat_url, request_body(target, prompts, index), record
            )
            on_done(record)

        if concurrency is not None:
            counter = iter(range(bounds.requests))

            async def worker() -> None:
                for index in counter:
                    if time.perf_counter() >= deadline:
                        return
                    await one(index, time.perf_counter())

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            lag_ms = 0.0
        else:
            times = arrival_times(rate, bounds.requests, seed, burstiness)
            tasks, lag_ms = [], 0.0
            for index, offset in enumerate(times):
                scheduled = start + float(offset)
                if scheduled >= deadline:
                    break
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                lag_ms = max(lag_ms, (time.perf_counter() - scheduled) * 1e3)
                tasks.append(asyncio.create_task(one(index, scheduled)))
            await asyncio.gather(*tasks)
        cpu_s = time.process_time() - cpu_before
        loop_lag = await probe.stop()
        after = await read_metrics(session, target.base_url)
    health = ClientHealth(
        max_schedule_lag_ms=lag_ms, loop_lag_p99_ms=loop_lag, cpu_s=cpu_s
    )
    arrival = (
        "closed" if rate is None else ("poisson" if burstiness is None else "gamma")
    )
    run = load_run(
        records,
        profile.slo_ttft_p99_ms,
        profile.slo_tpot_p99_ms,
        health,
        concurrency=concurrency,
        request_rate=rate,
        arrival=arrival,
        preemptions=max(after.preemptions - before.preemptions, 0),
        peak_concurrent_sequences=peak_running(before, after),
    )
    return run.model_copy(update={"burstiness": burstiness}) if burstiness else run


def saturated(runs: Sequence[LoadRun]) -> bool:
    """Whether a closed-loop sweep should stop: throughput gained less than
    SATURATION_GAIN over the level before, or the SLO failed at the last two."""
    if len(runs) < 2:
        return False
    last, previous = runs[-1], runs[-2]
    if not (last.meets_slo or previous.meets_slo):
        return True
    return last.request_throughput < previous.request_throughput * (1 + SATURATION_GAIN)


def concurrency_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to `max_concurrency` (included)."""
    levels, c = [], 1
    while c < max_concurrency:
        levels.append(c)
        c *= 2
    return [*levels, max_concurrency]


@dataclass
class Costs:
    """What a GPU costs, and the request rate to plan for."""

    gpu_hourly_usd: float = 0.0
    gpu_count: int = 1
    target_request_rate: float | None = None


def workload_report(
    profile: Profile,
    runs: Sequence[LoadRun],
    server: ServerSnapshot,
    costs: Costs,
    context_sweep: Sequence[LoadRun] = (),
) -> WorkloadReport:
    """A workload's report: headline numbers at the highest load that met the SLO
    (the run with the most requests/s among valid runs that met it)."""
    best = max(
        (r for r in runs if r.meets_slo and r.valid),
        key=lambda r: r.request_throughput,
        default=None,
    )
    fields: dict = {}
    if best is not None and best.request_throughput > 0:
        hourly = costs.gpu_hourly_usd * costs.gpu_count
        per_gpu_rate = best.request_throughput / costs.gpu_count
        fields = {
            "ttft_p99_ms": best.ttft_ms.p99,
            "tpot_p99_ms": best.tpot_ms.p99,
            "max_concurrency_at_slo": best.concurrency,
            "output_tokens_per_s_at_slo": best.output_tokens_per_s,
            "cost_per_1m_output_tokens": (
                hourly / (best.output_tokens_per_s * 3600) * 1e6
                if best.output_tokens_per_s
                else None
            ),
            "cost_per_request": hourly / (best.request_throughput * 3600),
            "requests_per_gpu_hour": per_gpu_rate * 3600,
            "sessions_per_gpu_at_slo": (
                best.concurrency / costs.gpu_count if best.concurrency else None
            ),
        }
        if costs.target_request_rate:
            fields["gpus_for_target_rate"] = math.ceil(
                costs.target_request_rate / per_gpu_rate
            )
    return WorkloadReport(
        profile=profile.name,
        prompt_tokens=profile.prompt_tokens,
        output_tokens=profile.output_tokens,
        context_tokens=profile.context_tokens,
        slo_ttft_p99_ms=profile.slo_ttft_p99_ms,
        slo_tpot_p99_ms=profile.slo_tpot_p99_ms,
        runs=list(runs),
        max_sessions_at_context=server.max_sessions(profile.context_tokens),
        target_request_rate=costs.target_request_rate,
        context_sweep=list(context_sweep),
        **fields,
    )
