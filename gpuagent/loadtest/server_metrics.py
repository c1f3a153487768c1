"""What the server says about itself on /metrics (Prometheus text): KV bytes per
token, blocks, block size, weights, running sequences, preemptions. This engine's
names first (`engine_*`), vLLM's where it has one; what a server doesn't export is
0 (unknown), never guessed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

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
    "running": ("engine_num_requests_running", "vllm:num_requests_running"),
    "preemptions": ("engine_preemptions_total", "vllm:num_preemptions_total"),
}


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
    running: int = 0
    preemptions: int = 0
    kv_cache_dtype: str = "unknown"

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
    dtype = "unknown"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, sample.value)
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
        key: int(next((samples[n] for n in names if n in samples), 0))
        for key, names in NAMES.items()
    }
    return ServerSnapshot(**values, kv_cache_dtype=dtype)


def running_sequences(text: str) -> int:
    """The running-sequences gauge of /metrics text, found without parsing it all
    (the watcher reads it 4 times a second, on the client's CPU)."""
    text = "\n" + text
    for name in NAMES["running"]:
        at = text.find("\n" + name)
        if at != -1:
            line = text[at + 1 : text.find("\n", at + 1)]
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def read_metrics(session: aiohttp.ClientSession, base_url: str) -> ServerSnapshot:
    """GET /metrics (an empty snapshot if the server has none)."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return ServerSnapshot()
            return parse_metrics(await resp.text())
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return ServerSnapshot()


class PeakWatcher:
    """Polls /metrics while a run goes on, keeping the most sequences seen running
    at once (a sampled peak: a spike shorter than `interval_s` can be missed; not
    faster, as each scrape costs the server CPU beside its engine)."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, interval_s: float = 0.25
    ) -> None:
        self.session, self.base_url, self.interval_s = session, base_url, interval_s
        self.peak = 0
        self._task: asyncio.Task | None = None

    async def _poll(self) -> None:
        while True:
            try:
                async with self.session.get(f"{self.base_url}/metrics") as resp:
                    text = await resp.text() if resp.status == 200 else ""
            except (aiohttp.ClientError, TimeoutError):
                text = ""
            self.peak = max(self.peak, running_sequences(text))
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Begin polling."""
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> int:
        """Stop polling, with a last reading; the peak."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        snapshot = await read_metrics(self.session, self.base_url)
        self.peak = max(self.peak, snapshot.running)
        return self.peak
