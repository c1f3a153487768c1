"""The agent's Celery app (no Django) and its heartbeat.

`python -m gpuagent run --name NAME --broker URL --artifacts PATH` starts a worker
of this app consuming the agent's own queue (agent.NAME) and its pool's queue. The
heartbeat thread sends `controlplane.fleet.record_heartbeat` with a Heartbeat (the
servers its serving Registry runs among it) every HEARTBEAT_S; the control plane
notices an agent whose beats stop and retries its job on another one. The embedded
control-plane worker runs the same task and the same heartbeat (see
`start_heartbeat`)."""

from __future__ import annotations

import logging
import os
import platform
import threading

from celery import Celery, current_app

from gpuagent.protocol import Heartbeat

log = logging.getLogger(__name__)
RECORD_HEARTBEAT = "controlplane.fleet.record_heartbeat"
HEARTBEAT_S = float(os.environ.get("GPUAGENT_HEARTBEAT_S", "3"))


def make_app(broker_url: str) -> Celery:
    app = Celery("gpuagent", broker=broker_url, include=["gpuagent.tasks"])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


def memory() -> tuple[str, str, int, int]:
    """(device, model, total bytes, free bytes): the GPU's, or the host's on CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return "cuda", torch.cuda.get_device_name(), int(total), int(free)
    except Exception:  # no torch, a broken driver: report the CPU instead
        log.warning("no GPU readable; reporting the CPU", exc_info=True)
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    model = platform.processor() or platform.machine()
    return "cpu", f"CPU {model}", info["MemTotal"], info.get("MemAvailable", 0)


def heartbeat() -> Heartbeat:
    from gpuagent.serving import loaded_deployments
    from gpuagent.tasks import agent

    me = agent()
    device, model, total, free = memory()
    with me.lock:
        running = sorted(me.running_jobs)
    deployments = loaded_deployments(me.registry)
    return Heartbeat(
        agent=me.name,
        queue=me.queue,
        pool_queue=me.pool_queue,
        device=device,
        gpu_model=model,
        memory_total_bytes=total,
        memory_free_bytes=free,
        running_jobs=running,
        deployments=deployments,
        can_sign=me.signing_key is not None,
    )


def start_heartbeat(app: Celery | None = None) -> threading.Event:
    """Beat every HEARTBEAT_S from a daemon thread until the returned event is set."""
    from gpuagent.tasks import agent

    app = app or current_app
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                app.send_task(
                    RECORD_HEARTBEAT,
                    args=[heartbeat().model_dump(mode="json")],
                    queue=agent().controlplane_queue,
                )
            except Exception:  # the broker is away: the next beat tries again
                log.warning("heartbeat not sent", exc_info=True)
            if stop.wait(HEARTBEAT_S):
                return

    threading.Thread(target=beat, name="gpuagent-heartbeat", daemon=True).start()
    return stop
