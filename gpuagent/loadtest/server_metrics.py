"""What the server says about itself on /metrics (Prometheus text): KV bytes per
token, blocks, block size, weights, preemptions, and the running sequences of each
engine step. This engine's names first (`engine_*`), vLLM's where it has one; what a
server doesn't export is 0 (unknown), never guessed.

The peak of concurrent sequences over a run comes from two readings, one before and
one after it, of `engine_iteration_num_requests_running`: a histogram the engine
observes once per step with one bucket per count (0 .. max_num_seqs). The highest
count whose bucket grew between the readings is the most sequences any step of the
run ran, exact however short the run, and the readings change nothing, so any
number of scrapers can read it at once. A server without that histogram (vLLM,
SGLang) has only a gauge of the running sequences now, whose samples miss short
peaks: its peak is 0 (unknown).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpuagent.engine.cache import blocks_needed

# field -> metric sample names, first found wins
NAMES = {
    "kv_bytes_per_token": ("engine_kv_bytes_per_token",),
    "kv_cache_bytes": ("engine_kv_cache_bytes",),
    "kv_blocks_total": ("engine_kv_blocks_total",),
    "kv_block_size_tokens": ("engine_kv_block_size_tokens",),
    "kv_blocks_used": ("engine_kv_blocks_used",),
    "weights_bytes": ("engine_weights_bytes",),
    "max_model_len": ("engine_max_model_len",),
    "preemptions": ("engine_preemptions_total", "vllm:num_preemptions_total"),
    "prefix_cache_queries": (
        "engine_prefix_cache_queries_total",
        "vllm:prefix_cache_queries_total",
    ),
    "prefix_cache_hits": (
        "engine_prefix_cache_hits_total",
        "vllm:prefix_cache_hits_total",
    ),
}
RUNNING_PER_STEP = "engine_iteration_num_requests_running"


@dataclass
class ServerSnapshot:
    """One reading of /metrics."""

    kv_bytes_per_token: int = 0
    kv_cache_bytes: int = 0
    kv_blocks_total: int = 0
    kv_block_size_tokens: int = 0
    kv_blocks_used: int = 0
    weights_bytes: int = 0
    max_model_len: int = 0
    preemptions: int = 0
    # prompt tokens looked up in / served by the prefix cache (cumulative; -1: the
    # server exports no such counter)
    prefix_cache_queries: int = -1
    prefix_cache_hits: int = -1
    kv_cache_dtype: str = "unknown"
    # RUNNING_PER_STEP's cumulative bucket counts: upper bound -> steps that ran at
    # most that many sequences (empty: the server has no such histogram)
    running_per_step: dict[float, float] = field(default_factory=dict)

    def max_sessions(self, context_tokens: int) -> int:
        """Sessions of `context_tokens` each that the KV pool holds at once (0 when
        the server doesn't say how big its pool is)."""
        if not (self.kv_blocks_total and self.kv_block_size_tokens):
            return 0
        per_session = blocks_needed(context_tokens, self.kv_block_size_tokens)
        return self.kv_blocks_total // per_session


def parse_metrics(text: str) -> ServerSnapshot:
    """A snapshot from Prometheus exposition text."""
    samples: dict[str, float] = {}
    running_per_step: dict[float, float] = {}
    dtype = "unknown"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, sample.value)
            if sample.name == RUNNING_PER_STEP + "_bucket":
                running_per_step[float(sample.labels["le"])] = sample.value
            if sample.name == "engine_kv_bytes_per_token":
                dtype = sample.labels.get("kv_cache_dtype", dtype)
            if sample.name == "vllm:cache_config_info":
                dtype = sample.labels.get("cache_dtype", dtype)
                samples.setdefault(
                    "engine_kv_blocks_total",
                    float(sample.labels.get("num_gpu_blocks") or 0),
                )
                samples.setdefault(
                    "engine_kv_block_size_tokens",
                    float(sample.labels.get("block_size") or 0),
                )
    values = {
        key: int(next((samples[n] for n in names if n in samples), missing))
        for key, names in NAMES.items()
        for missing in [-1 if key.startswith("prefix_cache") else 0]
    }
    return ServerSnapshot(
        **values, kv_cache_dtype=dtype, running_per_step=running_per_step
    )


def prefix_cache_hit_rate(
    before: ServerSnapshot, after: ServerSnapshot
) -> float | None:
    """Prefix-cache hits / queries between two readings, as the server counted
    them; None when it exports no such counters, looked nothing up in between, or
    restarted (a counter went down)."""
    if min(before.prefix_cache_queries, after.prefix_cache_queries) < 0:
        return None
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    if queries <= 0 or hits < 0 or hits > queries:
        return None
    return hits / queries


def peak_running(before: ServerSnapshot, after: ServerSnapshot) -> int:
    """The most sequences the server ran in one step between two readings: the
    highest count whose own (not cumulative) bucket grew. 0 (unknown) when either
    reading lacks the RUNNING_PER_STEP histogram, or a bucket's own count went down
    (the server restarted in between), or no step ran."""
    old = _own_counts(before.running_per_step)
    new = _own_counts(after.running_per_step)
    if not old or not new or any(new.get(b, 0.0) < n for b, n in old.items()):
        return 0
    grown = [b for b, n in new.items() if n > old.get(b, 0.0) and not math.isinf(b)]
    return int(max(grown, default=0))


def running_steps(
    before: ServerSnapshot, after: ServerSnapshot
) -> tuple[int, float] | None:
    """(engine steps that ran any sequence, their mean running sequences) between
    two readings, from the RUNNING_PER_STEP buckets (each bucket is one count, so
    the mean is exact); None when either reading lacks the histogram or the server
    restarted in between. A burst of arrivals shows as few steps of many
    sequences, the same requests spread out as more steps of fewer."""
    old = _own_counts(before.running_per_step)
    new = _own_counts(after.running_per_step)
    if not old or not new or any(new.get(b, 0.0) < n for b, n in old.items()):
        return None
    grown = {
        b: n - old.get(b, 0.0)
        for b, n in new.items()
        if b >= 1 and not math.isinf(b) and n > old.get(b, 0.0)
    }
    steps = sum(grown.values())
    if not steps:
        return 0, 0.0
    return int(steps), sum(b * n for b, n in grown.items()) / steps


def _own_counts(cumulative: dict[float, float]) -> dict[float, float]:
    """Histogram buckets as steps per bucket alone (each minus the one below)."""
    own, below = {}, 0.0
    for bound, count in sorted(cumulative.items()):
        own[bound], below = count - below, count
    return own


async def read_metrics(session: aiohttp.ClientSession, base_url: str) -> ServerSnapshot:
    """GET /metrics (an empty snapshot if the server has none)."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return ServerSnapshot()
            return parse_metrics(await resp.text())
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return ServerSnapshot()
