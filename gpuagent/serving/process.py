"""Server processes: start in their own session (so the whole group can be
signalled), wait for `/health` with a bound, stop with SIGTERM then SIGKILL.

A process is named by (pid, start time): the start time from /proc/<pid>/stat
tells a recycled pid from ours, so an agent restarted later never signals a
stranger's process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from gpuagent.serving.errors import PortTaken, StartError

HEALTH_POLL_S = 0.2
# Popen objects of the servers this process started: polling them reaps them, so
# a stopped server does not linger as a zombie of the agent.
_children: dict[int, subprocess.Popen] = {}


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when it is gone
    or a zombie (exited, not yet reaped: it serves nothing)."""
    _reap(pid)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and ")": split after the last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_running(pid: int, started: int) -> bool:
    """Whether the process `pid` that started at `started` still runs."""
    return start_time(pid) == started


def spawn(argv: Sequence[str], log_path: Path, env: dict[str, str]) -> tuple[int, int]:
    """Start `argv` (no shell) in a new session with stdout and stderr appended to
    `log_path`; returns (pid, start time)."""
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
    except OSError as e:
        raise StartError(f"cannot start {argv[0]!r}: {e}") from None
    _children[proc.pid] = proc
    started = start_time(proc.pid)
    if started is None:  # exited at once; the health wait reports the log
        started = -1
    return proc.pid, started


def stop(pid: int, started: int, grace_s: float = 10.0) -> bool:
    """SIGTERM the process group of `pid`, SIGKILL it after `grace_s`. Idempotent:
    a process already gone (or a recycled pid) is left alone. Returns whether the
    process was still running."""
    was_running = is_running(pid, started)
    if was_running:
        _kill_group_if_ours(pid, started, signal.SIGTERM)
        # A stopped process acts on SIGTERM only once continued.
        _kill_group_if_ours(pid, started, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and is_running(pid, started):
            time.sleep(0.05)
    # Past the grace, or helpers the leader left behind: nothing of it may stay.
    _kill_group_if_ours(pid, started, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and is_running(pid, started):
        time.sleep(0.05)
    _reap(pid)
    return was_running


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(host: str, port: int | None, port_range: tuple[int, int]) -> int:
    """`port` when free, else the first free port of `port_range`."""
    if port is not None:
        if not port_is_free(host, port):
            raise StartError(f"port {port} on {host} is in use")
        return port
    low, high = port_range
    for candidate in range(low, high + 1):
        if port_is_free(host, candidate):
            return candidate
    raise StartError(f"no free port in {low}-{high} on {host}")


def wait_healthy(
    base_url: str,
    pid: int,
    started: int,
    timeout_s: float,
    *,
    served_model_name: str | None,
    log_path: Path,
) -> None:
    """Poll `{base_url}/health` until it answers 200 while the process still runs.
    With `served_model_name`, `/v1/models` must list it too (a server of someone
    else's on the port does not count). Raises StartError (the process is NOT
    stopped here) when the process exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            if not is_running(pid, started):
                tail = log_tail(log_path)
                error = (
                    PortTaken
                    if "address already in use" in tail.lower()
                    else StartError
                )
                raise error(f"the server exited before answering /health: {tail}")
            if time.monotonic() >= deadline:
                raise StartError(
                    f"no healthy /health at {base_url} within {timeout_s:g} s: "
                    f"{log_tail(log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{base_url}/health").status_code == 200:
                    break
            time.sleep(HEALTH_POLL_S)
        port = int(base_url.rsplit(":", 1)[1])
        owners = port_listeners(port)
        if owners is not None and not owners & group_members(pid):
            # Another server took the port between our check and the child's bind:
            # its /health is not ours.
            raise PortTaken(
                f"port {port} is held by process(es) {sorted(owners)}, not by the "
                f"server started (pid {pid}): {log_tail(log_path)}"
            )
        if served_model_name is not None:
            names = _model_names(client, base_url)
            if served_model_name not in names:
                raise StartError(
                    f"the server at {base_url} serves {names}, not "
                    f"{served_model_name!r}: another server holds the port?"
                )
        if not is_running(pid, started):
            raise StartError(f"the server exited after /health: {log_tail(log_path)}")


def port_listeners(port: int) -> set[int] | None:
    """Pids holding a listening TCP socket on `port` (any address), from
    /proc/net/tcp{,6} and the processes' fds; None where /proc cannot tell."""
    inodes = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError):
                for line in Path(table).read_text().splitlines()[1:]:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{inode}]")
    except (OSError, ValueError, IndexError):
        return None
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        pids.add(int(entry.name))
                        break
    return pids


def group_members(pgid: int) -> set[int]:
    """Pids of the live processes of process group `pgid`."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                members.add(int(entry.name))
    return members


def health_ok(base_url: str, timeout_s: float = 5.0) -> bool:
    """Whether `{base_url}/health` answers 200 now."""
    try:
        return httpx.get(f"{base_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def log_tail(log_path: Path, max_bytes: int = 2000) -> str:
    """The end of a server's log, for error messages."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace").strip()
    except OSError:
        return "(no log)"
    return text or "(empty log)"


def _model_names(client: httpx.Client, base_url: str) -> list[str]:
    try:
        data = client.get(f"{base_url}/v1/models").json()
        return [str(m.get("id")) for m in data.get("data", [])]
    except (httpx.HTTPError, ValueError, AttributeError):
        return []


def _kill_group_if_ours(pid: int, started: int, sig: int) -> None:
    """Signal the group led by `pid` while it is ours: our leader runs, or no
    process holds the pid any more (Linux never hands out a pid that is still some
    group's id, so the group can then only hold the leader's leftovers)."""
    if start_time(pid) not in (None, started):
        return  # the pid now names another process: not ours to signal
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _reap(pid: int) -> None:
    proc = _children.get(pid)
    if proc is not None and proc.poll() is not None:
        _children.pop(pid, None)  # another thread may have reaped it
