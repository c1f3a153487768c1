"""This process as an agent: who it is (`Agent`, from the environment), its Celery
app (no Django), and its heartbeat.

`python -m gpuagent run --name NAME --broker URL --artifacts PATH` starts a worker
of this app consuming the agent's own queue (agent.NAME) and its pool's queue; the
embedded control-plane worker runs the same task (`--include=gpuagent.tasks`) and
the same heartbeat. When such a worker is ready (GPUAGENT_NAME set), it recovers
the servers its serving Registry names and starts the heartbeat thread, which
sends `controlplane.fleet.record_heartbeat` with a Heartbeat every HEARTBEAT_S; the
control plane notices an agent whose beats stop and retries its job on another
one. Every beat carries the agent's incarnation, new at every process start, so
an agent killed and restarted under the same name before its beats are missed is
still seen to have restarted (its jobs died with the earlier incarnation).

The job handlers (`gpuagent.tasks`) import this module; it never imports them.

Configuration (set by `python -m gpuagent run`, or the environment of the embedded
worker): GPUAGENT_NAME, GPUAGENT_ARTIFACTS, GPUAGENT_SIGNING_KEY (a PEM private
key: only the agent that signs holds it), GPUAGENT_TRUSTED_KEYS (PEM public keys,
comma-separated), GPUAGENT_CONTROLPLANE_QUEUE, GPUAGENT_POOL, GPUAGENT_THREADS,
GPUAGENT_ALLOWED_PROGRAMS (the whole argument shapes an external backend may
start, comma-separated: a preset's name, e.g. vllm, or a command template its
template must equal word for word; unset: any), GPUAGENT_IDENTITY_KEY
(this agent's Ed25519 identity key, created on first start with mode 0600;
default `<GPUAGENT_STATE_DIR>/identity.key`, the state folder defaulting to
`var/agent-state/<name>`), GPUAGENT_CONTROLPLANE_KEY (the control plane's public
key, PEM or hex, comma-separated for a rotation: job requests it did not sign are
refused), GPUAGENT_JOB_MAX_AGE_S (how old a signed job request may be: it may
wait in its queue; default 1200).

Every message this agent sends (heartbeat, progress, result) carries a seal
(gpuagent.integrity.identity) made with its identity key: the control plane
believes only messages sealed by an agent an operator enrolled."""

from __future__ import annotations

import logging
import os
import platform
import ssl
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from celery import Celery, current_app
from celery.signals import worker_ready
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpuagent import serving
from gpuagent.artifacts import ArtifactStore
from gpuagent.integrity import identity
from gpuagent.integrity.keys import public_key_pem
from gpuagent.protocol import DeviceInfo, Heartbeat
from gpuagent.serving import Registry

log = logging.getLogger(__name__)
RECORD_HEARTBEAT = "controlplane.fleet.record_heartbeat"
HEARTBEAT_S = float(os.environ.get("GPUAGENT_HEARTBEAT_S", "3"))


@dataclass
class Agent:
    """This agent: who it is, where its artifacts live, which keys it holds, and
    which start of it this is (`incarnation`, `started`)."""

    name: str
    store: ArtifactStore
    signing_key: Path | None
    trusted_keys: tuple[Path, ...]
    controlplane_queue: str
    pool_queue: str
    threads: int
    # Whole argument shapes an external backend may start (None: any; see
    # gpuagent.serving.templates.check_allowed_shape).
    allowed_programs: frozenset[str] | None = None
    running_jobs: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Random per process start: a restart under the same name is a new incarnation.
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    # This agent's Ed25519 identity key (None: `<store>/identity/<name>.key`),
    # and the control plane's public keys (raw) its job requests must be sealed by.
    identity_key_path: Path | None = None
    controlplane_keys: tuple[bytes, ...] = ()
    job_max_age_s: float = 1200.0
    _registry: Registry | None = None
    _identity: Ed25519PrivateKey | None = None

    @property
    def identity(self) -> Ed25519PrivateKey:
        """This agent's identity key, created on first use (mode 0600)."""
        if self._identity is None:
            path = self.identity_key_path or (
                self.store.root / "identity" / f"{self.name}.key"
            )
            self._identity = identity.load_or_create_key(path)
        return self._identity

    @property
    def fingerprint(self) -> str:
        return identity.fingerprint(identity.public_raw(self.identity))

    @property
    def queue(self) -> str:
        return f"agent.{self.name}"

    @property
    def registry(self) -> Registry:
        """The servers this agent runs and the digests it refuses to load."""
        if self._registry is None:
            self._registry = Registry(self.store.root / "serving")
        return self._registry

    def public_keys(self) -> tuple[Path, ...]:
        """Keys a signature may be made with: the trusted ones, and this agent's
        own signing key's public half."""
        keys = list(self.trusted_keys)
        if self.signing_key is not None:
            public = self.store.root / "keys" / f"{self.name}.pub.pem"
            if not public.is_file():
                public.parent.mkdir(exist_ok=True)
                public.write_bytes(public_key_pem(self.signing_key))
            keys.append(public)
        return tuple(keys)


_agent: Agent | None = None
_agent_lock = threading.Lock()


def agent() -> Agent:
    """This process's agent, from the environment (once: one incarnation per
    process)."""
    global _agent
    with _agent_lock:
        if _agent is None:
            _agent = agent_from_environment(os.environ)
    return _agent


def agent_from_environment(env) -> Agent:
    """An Agent configured by the GPUAGENT_* variables of `env`."""
    key = env.get("GPUAGENT_SIGNING_KEY") or None
    trusted = tuple(
        Path(p) for p in env.get("GPUAGENT_TRUSTED_KEYS", "").split(",") if p
    )
    name = env.get("GPUAGENT_NAME", "local")
    state = Path(env.get("GPUAGENT_STATE_DIR") or Path("var/agent-state") / name)
    controlplane_keys = tuple(
        identity.public_key_from_text(Path(p).read_text() if not _is_hex_key(p) else p)
        for p in env.get("GPUAGENT_CONTROLPLANE_KEY", "").split(",")
        if p
    )
    return Agent(
        name=name,
        store=ArtifactStore(env.get("GPUAGENT_ARTIFACTS", "var/artifacts")),
        signing_key=Path(key) if key else None,
        trusted_keys=trusted,
        controlplane_queue=env.get("GPUAGENT_CONTROLPLANE_QUEUE", "celery"),
        pool_queue=env.get("GPUAGENT_POOL", "agents"),
        threads=int(env.get("GPUAGENT_THREADS", "1")),
        allowed_programs=(
            frozenset(p for p in env["GPUAGENT_ALLOWED_PROGRAMS"].split(",") if p)
            if "GPUAGENT_ALLOWED_PROGRAMS" in env
            else None
        ),
        identity_key_path=Path(
            env.get("GPUAGENT_IDENTITY_KEY") or state / "identity.key"
        ),
        controlplane_keys=controlplane_keys,
        job_max_age_s=float(env.get("GPUAGENT_JOB_MAX_AGE_S", "1200")),
    )


def _is_hex_key(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def make_app(broker_url: str, name: str = "") -> Celery:
    """The agent's Celery app on `broker_url`, running gpuagent.tasks. With the
    agent's `name`, the messages it holds unacknowledged are kept under Redis
    keys of its own (unacked.agent.NAME...), so its Redis ACL user needs no
    access to the messages other agents and the control plane hold."""
    app = Celery("gpuagent", broker=broker_url, include=["gpuagent.tasks"])
    if name and broker_url.startswith(("redis://", "rediss://")):
        app.conf.broker_transport_options = {
            f"{key}_key": f"{key}.agent.{name}"
            for key in ("unacked", "unacked_index", "unacked_mutex")
        }
    app.conf.update(
        # The broker given, for reading and writing: Celery lets a
        # CELERY_BROKER_URL in the environment win over the constructor's broker
        # (an agent started with --broker rediss://... would go elsewhere).
        broker_read_url=broker_url,
        broker_write_url=broker_url,
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # No remote control: whoever can publish to the broker could otherwise
        # broadcast shutdown or pool commands to every agent (and its reply
        # queues would need their own Redis ACL keys).
        worker_enable_remote_control=False,
        # rediss://: check the broker's certificate (kombu's default for rediss://
        # without options is CERT_NONE); ssl_* parameters in the URL replace this.
        broker_use_ssl=(
            {"ssl_cert_reqs": ssl.CERT_REQUIRED}
            if broker_url.startswith("rediss://")
            else False
        ),
    )
    return app


def send_to_controlplane(task: str, *args, app: Celery | None = None) -> None:
    """Send the control plane's task named `task` to its queue. Nobody reads what
    it returns: no result store is asked to expect it."""
    # declare=[]: the control plane declares its own queue; an agent only pushes
    # to it (its Redis ACL user may write that list, not the queue's bindings).
    (app or current_app).send_task(
        task,
        args=list(args),
        queue=agent().controlplane_queue,
        ignore_result=True,
        declare=[],
    )


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


def devices() -> list[DeviceInfo]:
    """Every device this agent sees, by CUDA index, with its memory now; on a CPU
    agent one device (index 0) with the host's memory, as `memory` reports it."""
    try:
        import torch

        if torch.cuda.is_available():
            found = []
            for index in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(index)
                name = torch.cuda.get_device_name(index)[:100]
                found.append(DeviceInfo(index=index, model=name, **_bytes(total, free)))
            return found
    except Exception:  # no torch, a broken driver: report the CPU instead
        log.warning("no GPU readable; reporting the CPU", exc_info=True)
    _device, model, total, free = memory()
    return [DeviceInfo(index=0, model=model[:100], **_bytes(total, free))]


def _bytes(total: int, free: int) -> dict:
    return {"memory_total_bytes": int(total), "memory_free_bytes": int(free)}


def heartbeat() -> Heartbeat:
    """What this agent says about itself now."""
    me = agent()
    device, model, total, free = memory()
    with me.lock:
        running = sorted(me.running_jobs)
    return Heartbeat(
        agent=me.name,
        queue=me.queue,
        pool_queue=me.pool_queue,
        incarnation=me.incarnation,
        started=me.started,
        device=device,
        gpu_model=model,
        memory_total_bytes=total,
        memory_free_bytes=free,
        running_jobs=running,
        deployments=serving.loaded_deployments(me.registry),
        devices=devices(),
        can_sign=me.signing_key is not None,
        public_key=identity.public_raw(me.identity).hex(),
        signing_public_key=(
            public_key_pem(me.signing_key).decode() if me.signing_key else ""
        ),
    )


def sealed_heartbeat() -> tuple[dict, dict]:
    """(heartbeat, seal): the arguments of the control plane's record_heartbeat."""
    body = heartbeat().model_dump(mode="json")
    return body, identity.seal(agent().identity, body, type="heartbeat").model_dump(
        mode="json"
    )


def start_heartbeat(app: Celery | None = None) -> threading.Event:
    """Beat now, then every HEARTBEAT_S from a daemon thread until the returned
    event is set. The first beat leaves before the caller (the worker, once
    ready) takes a job, so the control plane hears of a new incarnation before it
    hears of that incarnation's jobs."""
    stop = threading.Event()

    def send() -> None:
        try:
            send_to_controlplane(RECORD_HEARTBEAT, *sealed_heartbeat(), app=app)
        except Exception:  # the broker is away: the next beat tries again
            log.warning("heartbeat not sent", exc_info=True)

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            send()

    send()
    threading.Thread(target=beat, name="gpuagent-heartbeat", daemon=True).start()
    return stop


@worker_ready.connect
def _start_agent(sender=None, **_) -> None:
    """Any worker that runs the agent's tasks as an agent (GPUAGENT_NAME set:
    `python -m gpuagent run`, or the embedded control-plane worker) recovers the
    servers it ran and sends heartbeats."""
    if os.environ.get("GPUAGENT_NAME"):
        me = agent()
        # What an operator compares before enrolling this agent.
        log.info("agent %s: identity key fingerprint %s", me.name, me.fingerprint)
        if not me.controlplane_keys:
            log.error("no control-plane key given: every job request is refused")
        # Servers started before a restart that still run are kept (and
        # reported); records of dead ones are dropped.
        found = serving.recover_deployments(agent().registry)
        if found:
            log.info("serving %d deployment(s) found running", len(found))
        start_heartbeat(sender.app if sender is not None else None)
