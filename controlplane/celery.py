"""The control plane's Celery app: configured from Django settings (CELERY_*), tasks
autodiscovered from each app's tasks.py. Start a worker with
`celery -A controlplane worker`."""

import os
import sys

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


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
