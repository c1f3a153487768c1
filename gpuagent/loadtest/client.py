"""The load tester's HTTP client: streamed chat completions over one aiohttp session
(no connection limit, so hundreds of streams share one event loop on one core),
timestamping each content chunk as it arrives.

A chunk counts as a token arrival only when it carries content: the role-only first
chunk a chat stream opens with is not the first token. Output tokens are the
server's `usage.completion_tokens` (asked for with `stream_options.include_usage`),
not a count of chunks, which may hold several tokens or none.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

DATA_PREFIX = b"data:"


@dataclass
class RequestRecord:
    """What one request did, in `time.perf_counter()` seconds."""

    scheduled_s: float = 0.0  # when the schedule wanted it sent (open loop)
    start_s: float = 0.0  # when it was sent
    chunk_times_s: list[float] = field(default_factory=list)  # content arrivals
    end_s: float = 0.0  # when the stream ended
    prompt_tokens: int = 0
    output_tokens: int = 0  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details (None: absent)
    text: str = ""  # the answer's content, kept only when asked (a session's history)
    error: str = ""

    @property
    def ok(self) -> bool:
        """Finished without an error and with at least one content chunk."""
        return not self.error and bool(self.chunk_times_s)

    @property
    def ttft_s(self) -> float:
        """Sent -> first content chunk."""
        return self.chunk_times_s[0] - self.start_s

    @property
    def e2e_s(self) -> float:
        """Sent -> last content chunk (vLLM's benchmark's latency)."""
        return self.chunk_times_s[-1] - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for a single token."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between successive content chunks."""
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def new_session(timeout_s: float) -> aiohttp.ClientSession:
    """A session with no connection cap (each stream its own connection) and a
    total timeout per request."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    keep_text: bool = False,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """POST `body` (stream=true, usage in the stream) to `url` and fill `record`
    (with `keep_text`, the answer's text too); every failure (connection, HTTP
    status, an error event, a stream cut short, no usage) ends up in
    `record.error`, never raised."""
    record.start_s = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                record.error = f"HTTP {resp.status}: {text}"
                return record
            done, parts = False, []
            async for line in resp.content:
                now = time.perf_counter()
                if not line.startswith(DATA_PREFIX):
                    continue
                payload = line[len(DATA_PREFIX) :].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    record.error = f"error event: {event['error']}"
                    return record
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    content = delta.get("content") or choice.get("text")
                    if content:
                        record.chunk_times_s.append(now)
                        if keep_text:
                            parts.append(content)
                usage = event.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens", 0)
                    record.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if isinstance(details.get("cached_tokens"), int):
                        record.cached_tokens = details["cached_tokens"]
            record.end_s = time.perf_counter()
            record.text = "".join(parts)
            if not done:
                record.error = "the stream ended without [DONE]"
            elif not record.output_tokens:
                record.error = "no usage in the stream"
            elif not record.chunk_times_s:
                record.error = "no content in the stream"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record
