"""What an agent reports about itself beyond the fleet table's fixed columns, as
(label, text) pairs: its capabilities and any field of Agent.to_dict() the table
does not show yet. Heartbeats will carry more fields (memory in use, current jobs,
engine state); each one shows here the day to_dict() has it, without a template
change, and a field the page doesn't know can't break it."""

import json

from controlplane.dashboard.templatetags.dashboard import binary_size

# Fields the fleet table shows in columns of their own (or that are not facts).
SHOWN_FIELDS = frozenset(
    {
        "id",
        "name",
        "queue",
        "gpu_model",
        "gpu_memory_bytes",
        "last_heartbeat",
        "state",
        "capabilities",
    }
)


def _label(key: str) -> str:
    return key.removesuffix("_bytes").replace("_", " ")


def device_text(device: dict) -> str:
    """One device as "#1 NVIDIA H100 (80.0 GiB, 70.0 GiB free)"."""
    memory = binary_size(device.get("memory_total_bytes", 0))
    if device.get("memory_free_bytes") is not None:
        memory += f", {binary_size(device['memory_free_bytes'])} free"
    return f"#{device.get('index')} {device.get('model', '')} ({memory})"


def _text(key: str, value) -> str:
    if key.endswith("devices") and isinstance(value, list):
        items = [device_text(d) if isinstance(d, dict) else str(d) for d in value]
        return "; ".join(items) or "none"
    if key.endswith("_bytes") and isinstance(value, int | float):
        return binary_size(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(_text("", item) for item in value) or "none"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def agent_facts(agent) -> list[tuple[str, str]]:
    data = agent.to_dict()
    capabilities = data.get("capabilities") or {}
    if not isinstance(capabilities, dict):
        capabilities = {"capabilities": capabilities}
    reported = {k: v for k, v in data.items() if k not in SHOWN_FIELDS}
    facts = []
    for key, value in [*sorted(reported.items()), *sorted(capabilities.items())]:
        if value is None or value == "":
            continue
        facts.append((_label(key), _text(key, value)))
    return facts
