"""One load level's `LoadRun` from its request records (definitions as vLLM's
benchmark client names them; see ../shared/REFERENCE.md):

- TTFT: sent -> first content chunk; E2E: sent -> last content chunk;
- TPOT: (E2E - TTFT) / (output tokens - 1) per request, output tokens from `usage`;
- ITL: gaps between successive content chunks, pooled over requests;
- throughput over the run's wall time (first send -> last end); goodput: requests/s
  that met both SLO bounds themselves (TTFT and TPOT);
- the level meets the SLO when TTFT p99 and TPOT p99 are within it, nothing failed
  and the run is valid (the client kept its schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpuagent.loadtest.client import RequestRecord
from gpuagent.protocol import LoadRun, Percentiles

# A client that sends a request this much later than its schedule, or whose event
# loop answers a timer this late (p99), measured itself more than the server: the
# run is marked invalid.
MAX_SCHEDULE_LAG_MS = 100.0
MAX_LOOP_LAG_P99_MS = 25.0


def percentiles(values_s: Sequence[float]) -> Percentiles:
    """p50/90/95/99 of `values_s` in milliseconds (zeros for none)."""
    if not len(values_s):
        return Percentiles(p50=0.0, p90=0.0, p95=0.0, p99=0.0)
    p50, p90, p95, p99 = np.percentile(np.asarray(values_s) * 1e3, [50, 90, 95, 99])
    return Percentiles(p50=float(p50), p90=float(p90), p95=float(p95), p99=float(p99))


@dataclass
class ClientHealth:
    """How the client itself did during a run."""

    max_schedule_lag_ms: float = 0.0
    loop_lag_p99_ms: float = 0.0
    cpu_s: float = 0.0

    @property
    def kept_up(self) -> bool:
        """Whether the client kept its schedule and its timers."""
        return (
            self.max_schedule_lag_ms <= MAX_SCHEDULE_LAG_MS
            and self.loop_lag_p99_ms <= MAX_LOOP_LAG_P99_MS
        )


def load_run(
    records: Sequence[RequestRecord],
    slo_ttft_p99_ms: float,
    slo_tpot_p99_ms: float,
    health: ClientHealth,
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    arrival: str = "closed",
    prompt_tokens: int | None = None,
    preemptions: int = 0,
    peak_concurrent_sequences: int = 0,
) -> LoadRun:
    """The LoadRun of one level from its records."""
    ok = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    if records:
        first = min(r.start_s for r in records)
        last = max(max(r.end_s, r.start_s) for r in records)
        duration = max(last - first, 1e-9)
    else:
        duration = 0.0
    ttft = [r.ttft_s for r in ok]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    itl = [gap for r in ok for gap in r.itls_s]
    e2e = [r.e2e_s for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    ttft_p = percentiles(ttft)
    tpot_p = percentiles(tpot)
    good = [
        r
        for r in ok
        if r.ttft_s * 1e3 <= slo_ttft_p99_ms
        and (r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_p99_ms)
    ]
    valid = health.kept_up
    rate = (lambda n: n / duration) if duration else (lambda n: 0.0)
    return LoadRun(
        concurrency=concurrency,
        request_rate=request_rate,
        num_requests=len(ok),
        num_errors=len(errors),
        duration_s=duration,
        ttft_ms=ttft_p,
        tpot_ms=tpot_p,
        itl_ms=percentiles(itl),
        e2e_ms=percentiles(e2e),
        request_throughput=rate(len(ok)),
        output_tokens_per_s=rate(output_tokens),
        goodput=rate(len(good)),
        meets_slo=bool(
            ok
            and not errors
            and valid
            and ttft_p.p99 <= slo_ttft_p99_ms
            and tpot_p.p99 <= slo_tpot_p99_ms
        ),
        valid=valid,
        preemptions=preemptions,
        peak_concurrent_sequences=peak_concurrent_sequences,
        arrival=arrival,
        prompt_tokens=(
            prompt_tokens
            if prompt_tokens is not None
            else (round(float(np.mean([r.prompt_tokens for r in ok]))) if ok else 0)
        ),
        output_tokens=output_tokens,
        errors=sorted({r.error for r in errors})[:5],
        max_schedule_lag_ms=health.max_schedule_lag_ms,
        loop_lag_p99_ms=health.loop_lag_p99_ms,
        client_cpu_s=health.cpu_s,
        client_cpu_us_per_token=(
            health.cpu_s * 1e6 / output_tokens if output_tokens else 0.0
        ),
    )
