"""Start and stop the project's engine server for a candidate folder: the one
place the agent's jobs (deploy, load_test) start a server, so a serving backend
(gpuagent.serving: templates, external engines) can replace it here alone.

The server process is `python -m gpuagent.engine serve DIR` with the engine's
verify-on-load (`--manifest-digest`, and `--signature` with the trusted public keys
and the release binding): it refuses to load bytes that are not the approved ones.
The deploy job verifies the folder before calling this (gpuagent.tasks
verify_candidate), so a mismatch is reported as which files are missing, extra or
changed rather than as a server that never came up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HEALTH_TIMEOUT_S = 120.0


class ServeError(RuntimeError):
    """The server could not be started; `verification` when the bytes were wrong."""

    def __init__(self, message: str, *, verification: bool = False):
        super().__init__(message)
        self.verification = verification


@dataclass(frozen=True)
class ServerProcess:
    pid: int
    endpoint: str
    log_path: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_engine_server(
    model_dir: Path,
    *,
    kv_cache_dtype: str,
    manifest_digest: str,
    log_path: Path,
    signature_path: Path | None = None,
    public_keys: tuple[Path, ...] = (),
    binding: tuple[str, str, str] | None = None,
    threads: int = 1,
    kv_memory_gb: float = 0.05,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
) -> ServerProcess:
    """Start the engine server for `model_dir` (which verifies it on load against
    `manifest_digest`); returns once /health answers. The process outlives the
    caller (its own session) until `stop_server`."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "gpuagent.engine",
        "serve",
        str(model_dir),
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--kv-memory-gb",
        str(kv_memory_gb),
        "--served-model-name",
        "candidate",
        "--manifest-digest",
        manifest_digest,
        "--log-level",
        "warning",
    ]
    if signature_path is not None:
        command += ["--signature", str(signature_path)]
        for key in public_keys:
            command += ["--public-key", str(key)]
        if binding is not None:
            model, version, recipe = binding
            command += [
                "--release-model",
                model,
                "--release-version",
                version,
                "--release-recipe",
                recipe,
            ]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + health_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-1500:]
            raise ServeError(
                f"engine server exited with {process.returncode}: {tail.strip()}",
                verification="integrity" in tail.lower() or "digest" in tail.lower(),
            )
        if healthy(endpoint):
            return ServerProcess(process.pid, endpoint, str(log_path))
        time.sleep(0.25)
    stop_server(process.pid)
    raise ServeError(f"engine server not healthy after {health_timeout_s:.0f}s")


def healthy(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop_server(pid: int, timeout_s: float = 10.0) -> bool:
    """Stop the server process `pid` (TERM, then KILL); False if it was gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            finished, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child: poll for it to go
            finished = 0 if _alive(pid) else pid
        if finished:
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
