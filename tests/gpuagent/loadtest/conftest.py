"""A scripted streaming server in its own process (its CPU is not the client's)."""

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.gpuagent.serving import free_port

REPO = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def scripted_server(*flags: str):
    """Base URL of `scripted_server` run with `flags`, stopped afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.gpuagent.loadtest.scripted_server"]
        + ["--port", str(port), *flags],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "scripted server did not start"
            try:
                httpx.get(f"{base}/v1/models", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def scripted():
    """`scripted(*flags)`: a context manager giving a scripted server's URL."""
    return scripted_server
