"""Where on an agent a deployment runs: a pure function over the devices the
agent is enrolled to use, the servers already on it, and the release's memory
need. No database, no agent: controlplane.releases.placing gathers the inputs.

A device hands out USABLE_FRACTION of its enrolled memory (the rest is the CUDA
context and the allocator's); each server on it holds its budget; and never
more than the device's free memory in its agent's latest beat plus what the
servers the placement stops free there (vLLM refuses to start with less free
memory than its share; another process may hold some). A deployment gets
`device_count` devices (1 for the project's engine, the tensor-parallel size
for an external one) each with room for its need, preferring devices no server
uses (disjoint from the warm ones), then the emptiest. When none fits, the
placement makes room, fewest servers stopped first: the environment's earlier
releases kept warm for rollback (oldest first: they go cold, kept verified on
disk and restarted on rollback), then, last, what the environment serves now (a
cold swap: the new release starts after the old one stopped). Another
environment's servers are never stopped.

The memory need (`memory_need`), per device: the project's engine holds its
weights (counted twice on a CPU agent for a release not in fp16: the engine
computes in float32 there) and its KV pool; an external engine (vLLM) holds its
share of the weights, the KV cache of one sequence of the context it plans for,
and the activation headroom of its profiling run and CUDA graphs. An
environment that sets gpu_memory_utilization claims that share of each device
instead, when larger (vLLM fills it with KV cache)."""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gpuagent.protocol import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_MODEL_LEN,
    BackendSpec,
    Placement,
    engine_kv_budget_bytes,
)

GIB = 2**30
USABLE_FRACTION = DEFAULT_GPU_MEMORY_UTILIZATION
# vLLM's profiling run and CUDA graphs per device (gpuagent.sizing.Knobs' default).
EXTERNAL_ACTIVATION_HEADROOM_BYTES = 4 * GIB


@dataclass(frozen=True)
class Device:
    """An enrolled device: its total memory (the enrollment's) and the free
    memory its agent's latest beat reported (None: not reported)."""

    index: int
    memory_total_bytes: int
    model: str = ""
    memory_free_bytes: int | None = None


@dataclass(frozen=True)
class Resident:
    """A server on the agent: its deployment, devices and budget, and what the
    placement may do with it: "rollback" (an earlier release of the environment
    being deployed, kept warm: may go cold), "serving" (what that environment
    serves now: stopped only for a cold swap), "other" (never stopped)."""

    deployment_id: int
    serving_id: str
    devices: tuple[int, ...]
    budget_bytes: int
    role: Literal["rollback", "serving", "other"]
    label: str = ""


@dataclass(frozen=True)
class Need:
    bytes_per_device: int
    device_count: int = 1
    fraction_of_total: float | None = None


@dataclass(frozen=True)
class Placed:
    """The result: `placement` (devices, budget, servers stopped first) and the
    residents it stops, or None with the `reason` nothing fits."""

    placement: Placement | None
    stopped: tuple[Resident, ...] = ()
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.placement is not None


def memory_need(
    *,
    weights_bytes: int,
    kv_bytes_per_token: int,
    weights_format: str,
    backend: BackendSpec,
    on_cpu: bool,
) -> Need:
    """What a release needs on each device it is placed on (module docstring)."""
    if backend.kind == "engine":
        factor = 2 if on_cpu and weights_format != "fp16" else 1
        kv = engine_kv_budget_bytes(backend.kv_memory_gb)
        return Need(weights_bytes * factor + kv)
    shards = backend.tensor_parallel_size
    context = backend.max_model_len or DEFAULT_MAX_MODEL_LEN
    per_device = (
        math.ceil(weights_bytes / shards)
        + math.ceil(kv_bytes_per_token * context / shards)
        + EXTERNAL_ACTIVATION_HEADROOM_BYTES
    )
    return Need(per_device, shards, backend.gpu_memory_utilization)


def place(
    devices: Sequence[Device], residents: Sequence[Resident], need: Need
) -> Placed:
    """Devices and a budget for `need` beside `residents`, stopping as few of them
    as it takes (module docstring); a reason when even that does not fit."""
    if not devices:
        return Placed(None, reason="the agent is enrolled to use no devices")
    if need.device_count > len(devices):
        return Placed(
            None,
            reason=f"it needs {need.device_count} devices; the agent is enrolled "
            f"to use {len(devices)}",
        )
    stoppable = sorted(
        (r for r in residents if r.role == "rollback"), key=lambda r: r.deployment_id
    ) + [r for r in residents if r.role == "serving"]
    for count in range(len(stoppable) + 1):
        stopped = tuple(stoppable[:count])
        kept = [r for r in residents if r not in stopped]
        placement = _choose(devices, kept, need, stopped)
        if placement is not None:
            # A server stopped on none of the chosen devices made no room: kept.
            chosen = set(placement.devices)
            needed = tuple(r for r in stopped if chosen & set(r.devices))
            update = {"stop_first": [r.serving_id for r in needed]}
            return Placed(placement.model_copy(update=update), needed)
    room = ", ".join(f"#{d.index} {_gib(_capacity(d, []))} usable" for d in devices)
    others = [r for r in residents if r.role == "other"]
    held = f"; other environments' servers hold {_gib(_held(others))}" if others else ""
    return Placed(
        None,
        reason=f"it needs {_gib(_need_on(need, devices[0]))} on each of "
        f"{need.device_count} device(s); the agent has {room}{held}",
    )


def _choose(
    devices: Sequence[Device],
    kept: Sequence[Resident],
    need: Need,
    stopped: tuple[Resident, ...],
) -> Placement | None:
    used = {i for r in kept for i in r.devices}

    def room(d: Device) -> int:
        return _capacity(d, kept, stopped)

    fitting = [d for d in devices if room(d) >= _need_on(need, d)]
    # Disjoint from the warm servers first, then the most room, then by index.
    fitting.sort(key=lambda d: (d.index in used, -room(d), d.index))
    chosen = sorted(fitting[: need.device_count], key=lambda d: d.index)
    if len(chosen) < need.device_count:
        return None
    budget = max(_need_on(need, d) for d in chosen)
    if any(budget > room(d) for d in chosen):
        return None  # devices of unequal size: the largest need fits not all
    return Placement(
        devices=[d.index for d in chosen],
        memory_budget_bytes=budget,
        device_memory_total_bytes=min(d.memory_total_bytes for d in chosen),
        stop_first=[r.serving_id for r in stopped],
    )


def _capacity(
    device: Device, kept: Sequence[Resident], stopped: Sequence[Resident] = ()
) -> int:
    usable = math.floor(device.memory_total_bytes * USABLE_FRACTION)
    room = usable - sum(r.budget_bytes for r in kept if device.index in r.devices)
    if device.memory_free_bytes is None:
        return room
    freed = sum(r.budget_bytes for r in stopped if device.index in r.devices)
    return min(room, device.memory_free_bytes + freed)


def _need_on(need: Need, device: Device) -> int:
    if need.fraction_of_total is None:
        return need.bytes_per_device
    claimed = math.floor(device.memory_total_bytes * need.fraction_of_total)
    return max(need.bytes_per_device, claimed)


def _held(residents: Sequence[Resident]) -> int:
    return sum(r.budget_bytes * len(r.devices) for r in residents)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
