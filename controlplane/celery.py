"""The control plane's Celery app: configured from Django settings (CELERY_*), tasks
autodiscovered from each app's tasks.py. Start a worker with
`celery -A controlplane worker`.

Children die with their parent: the beat a worker runs embedded (`--beat`, a
forked child process) and the worker the demo starts ask the kernel for SIGTERM
when their parent ends (PR_SET_PDEATHSIG), so a worker killed with SIGKILL leaves
no beat behind, still sending the periodic tasks. SIGTERM is what the worker
itself sends its beat on a normal stop (beat then syncs its schedule and exits),
and a worker's warm shutdown."""

import ctypes
import os
import signal
import sys
from collections.abc import Callable

from celery import Celery
from celery.signals import beat_embedded_init, worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded before any fork: a preexec_fn runs between fork and exec, where loading a
# library could wait on a lock another thread of the parent held.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
# The worker process, recorded before it forks its embedded beat.
_worker_pid: int | None = None


def die_with_parent(sig: int, *, parent_pid: int) -> None:
    """Have the kernel send this process `sig` when its parent (`parent_pid`, the
    process that started it) ends; exit at once if it already has (it ended
    between the fork and now). Linux only: elsewhere it does nothing (and logs
    nothing: it may run between a fork and an exec)."""
    if _libc is None:
        return
    if _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent_pid:
        os._exit(0)


def dies_with_this_process(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child is sent `sig` when the
    process calling this ends, however it ends (SIGKILL included)."""
    parent_pid = os.getpid()
    return lambda: die_with_parent(sig, parent_pid=parent_pid)


@worker_init.connect
def _record_worker_pid(**_) -> None:
    global _worker_pid
    _worker_pid = os.getpid()


@beat_embedded_init.connect
def _beat_dies_with_its_worker(**_) -> None:
    """In the beat child of a worker started with `--beat`."""
    die_with_parent(signal.SIGTERM, parent_pid=_worker_pid or os.getppid())


def worker_command(
    *extra_args: str, pool: str = "solo", concurrency: int = 1
) -> list[str]:
    """The command line of one worker process for this app (the demo and the
    worker integration tests start it as a real subprocess): single-threaded unless
    `pool`/`concurrency` say otherwise."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "controlplane",
        "worker",
        f"--pool={pool}",
        f"--concurrency={concurrency}",
        "--without-gossip",
        "--without-mingle",
        *extra_args,
        "--loglevel=INFO",
    ]
