"""guidellm's benchmark report (its `--output kind=json` file, guidellm 0.8) read
into our metrics: each of its benchmarks becomes our `LoadRun`, computed by
`metrics.load_run` from guidellm's per-request timestamps, so the SLO, the knee and
the goodput are judged by our definitions and not by guidellm's own summaries.

Per request (`benchmarks[i].requests.successful|errored`, each one's
`info.timings`): sent = `request_start`, first content = `first_token_iteration`,
last content = `last_token_iteration`, so TTFT, E2E and TPOT ((E2E - TTFT) /
(tokens - 1)) are ours; the token counts are the request's `prompt_tokens` and
`output_tokens` (the server's usage, which guidellm prefers). guidellm keeps no
time per chunk, so the gaps between chunks (our ITL) are not known: a run read here
has no ITL (zeros). Requests guidellm left `incomplete` (stopped by a constraint
in flight) are left out, as our plan runner leaves out a request the budget cut;
errored ones count as errors.

The load is the benchmark's strategy: `concurrent` (its `streams`) is our closed
loop, `poisson` (its `rate`) our open loop. For the open loop the client's lag
behind its schedule is the largest `request_start - targeted_start`, held to our
limit (`metrics.MAX_SCHEDULE_LAG_MS`) as our own runs are; guidellm's event loop is
not probed (its lag reads 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuagent.loadtest.client import RequestRecord
from gpuagent.loadtest.metrics import ClientHealth, load_run
from gpuagent.protocol import LoadRun, Percentiles

NO_ITL = Percentiles(p50=0.0, p90=0.0, p95=0.0, p99=0.0)


class GuidellmReportError(ValueError):
    """A guidellm report this reader can't use; the message says what is missing."""


def _timings(request: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        return request["info"]["timings"]
    except (KeyError, TypeError):
        raise GuidellmReportError(
            f"request {request.get('request_id', '?')}: no info.timings"
        ) from None


def record_of(request: Mapping[str, Any], error: str = "") -> RequestRecord:
    """Our record of one guidellm request (`error` for one guidellm counts as
    errored; its own error text is used where it has one)."""
    timings = _timings(request)
    start = timings.get("request_start")
    if start is None:
        raise GuidellmReportError(
            f"request {request.get('request_id', '?')}: no timings.request_start"
        )
    chunks = [
        t
        for t in (
            timings.get("first_token_iteration"),
            timings.get("last_token_iteration"),
        )
        if t is not None
    ]
    if len(chunks) == 2 and chunks[0] == chunks[1]:
        chunks = chunks[:1]  # one content chunk
    targeted = timings.get("targeted_start")
    if error:
        error = str((request.get("info") or {}).get("error") or error)
    return RequestRecord(
        scheduled_s=targeted if targeted is not None else start,
        start_s=start,
        chunk_times_s=chunks,
        end_s=timings.get("request_end") or (chunks[-1] if chunks else start),
        prompt_tokens=int(request.get("prompt_tokens") or 0),
        output_tokens=int(request.get("output_tokens") or 0),
        cached_tokens=request.get("cached_tokens"),
        error=error,
    )


def strategy_of(benchmark: Mapping[str, Any]) -> tuple[str, float]:
    """("concurrent", streams) or ("poisson", rate) of one benchmark; any other
    strategy is refused by name."""
    try:
        strategy = benchmark["config"]["strategy"]
        kind = strategy["type_"]
    except (KeyError, TypeError):
        raise GuidellmReportError("a benchmark has no config.strategy.type_") from None
    if kind == "concurrent":
        return kind, float(strategy["streams"])
    if kind == "poisson":
        return kind, float(strategy["rate"])
    raise GuidellmReportError(
        f"strategy {kind!r} is not read here (concurrent or poisson only)"
    )


def run_of(
    benchmark: Mapping[str, Any], slo_ttft_p99_ms: float, slo_tpot_p99_ms: float
) -> LoadRun:
    """One guidellm benchmark as our LoadRun, judged against the SLO given."""
    kind, level = strategy_of(benchmark)
    requests = benchmark.get("requests") or {}
    if "successful" not in requests:
        raise GuidellmReportError(
            "a benchmark has no requests.successful (was it run with sample_size=0?)"
        )
    records = [record_of(r) for r in requests["successful"]]
    records += [record_of(r, "errored") for r in requests.get("errored") or ()]
    lag_ms = 0.0
    if kind == "poisson" and records:
        lag_ms = max(max((r.start_s - r.scheduled_s) * 1e3 for r in records), 0.0)
    run = load_run(
        records,
        slo_ttft_p99_ms,
        slo_tpot_p99_ms,
        ClientHealth(max_schedule_lag_ms=lag_ms),
        concurrency=int(level) if kind == "concurrent" else None,
        request_rate=level if kind == "poisson" else None,
        arrival="closed" if kind == "concurrent" else "poisson",
    )
    return run.model_copy(update={"itl_ms": NO_ITL})


def runs_of(
    report: Mapping[str, Any], slo_ttft_p99_ms: float, slo_tpot_p99_ms: float
) -> list[LoadRun]:
    """Every benchmark of a guidellm report, in its order."""
    benchmarks: Sequence[Mapping[str, Any]] | None = report.get("benchmarks")
    if not benchmarks:
        raise GuidellmReportError("the report has no benchmarks")
    return [run_of(b, slo_ttft_p99_ms, slo_tpot_p99_ms) for b in benchmarks]
