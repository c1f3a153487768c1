"""Live servers for tests: the engine's OpenAI server on 127.0.0.1 (uvicorn in a
thread, on a free port), and readers of its /metrics and SSE streams."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from gpuagent.engine.engine import AsyncLLMEngine, LLMEngine
from gpuagent.engine.server import build_app

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(
    engine: LLMEngine, model_name: str = MODEL, **app_kwargs: Any
) -> Iterator[tuple[str, AsyncLLMEngine]]:
    """Serve `engine` on 127.0.0.1 in a thread: yields (base URL, AsyncLLMEngine)."""
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, model_name, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", async_engine
    finally:
        server.should_exit = True
        thread.join(10)


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_until_idle(base_url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            metric(base_url, "engine_kv_blocks_used") == 0
            and metric(base_url, "engine_num_requests_running") == 0
        ):
            return
        time.sleep(0.05)
    raise AssertionError("engine still holds blocks")


def sse_events(lines):
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield None if payload == "[DONE]" else json.loads(payload)
