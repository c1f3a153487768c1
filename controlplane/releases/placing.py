"""Placing a deployment before its deploy job is sent: the inputs of
controlplane.fleet.placement read from the database (the release's memory need
from its recorded evidence, the devices each live agent is enrolled to use, the
servers warm on it), the agent chosen, and the result recorded through
actions.deployments.do_place_deployment.

The weights a release loads are the compress job's expected GPU weight bytes
(else the signed files' total size); its KV bytes per token are what its load
test measured at the recipe's KV dtype (0 when there is none yet). A release
whose weight size nothing recorded, or an environment with no live agent
enrolled with devices, is not placed: its deploy job goes to the pool and the
agent serves on its whole machine, as before placement. A deploy of a release
whose earlier server still runs on a live agent (a rollback to a warm target)
goes back to that server, on its placement."""

from django.db.models import QuerySet

from controlplane.fleet.backend import job_backend
from controlplane.fleet.models import SERVING_STATES, Agent, Deployment
from controlplane.fleet.placement import (
    Device,
    Need,
    Placed,
    Resident,
    memory_need,
    place,
)
from controlplane.releases import evidence
from controlplane.releases.actions.deployments import do_place_deployment
from controlplane.releases.models import Release

WORKER = "system:worker"


def weights_bytes(release: Release) -> int:
    """The bytes of weights `release` loads (0: nothing recorded)."""
    compressed = evidence.latest_succeeded(release, "compress")
    if compressed is not None:
        report = compressed.result.get("report") or {}
        expected = report.get("expected_gpu_weight_bytes")
        if isinstance(expected, int) and expected > 0:
            return expected
    return sum(release.artifacts.values_list("size_bytes", flat=True))


def kv_bytes_per_token(release: Release) -> int:
    """KV bytes per token its load test measured (0: none yet)."""
    try:
        report = evidence.load_report(release)
    except evidence.EvidenceUnreadable:
        return 0
    return report.kv_bytes_per_token if report is not None else 0


def need_for(release: Release, deployment: Deployment, agent: Agent) -> Need | None:
    weights = weights_bytes(release)
    if not weights:
        return None
    return memory_need(
        weights_bytes=weights,
        kv_bytes_per_token=kv_bytes_per_token(release),
        weights_format=release.recipe.get("weights", ""),
        backend=job_backend(deployment.environment.serving_backend),
        on_cpu=agent.device == "cpu",
    )


def residents(agent: Agent, deployment: Deployment) -> list[Resident]:
    """The servers on `agent` that hold memory, as the placement of `deployment`
    sees them (one per server: the newest deployment that names it)."""
    rows = (
        Deployment.objects.filter(agent=agent, placement__isnull=False)
        .exclude(pk=deployment.pk)
        .select_related("release")
        .order_by("-started", "-id")
    )
    found: dict[str, Resident] = {}
    for row in rows:
        deploying = row.state == "deploying" and row.ended is None
        if not (row.warm or deploying):
            continue
        key = row.serving_id or f"deploying:{row.pk}"
        if key in found:
            continue
        serving = row.state in SERVING_STATES and row.ended is None
        if row.environment_id != deployment.environment_id or not row.serving_id:
            role = "other"
        else:
            role = "serving" if serving else "rollback"
        found[key] = Resident(
            deployment_id=row.pk,
            serving_id=row.serving_id,
            devices=tuple(row.placement["devices"]),
            budget_bytes=row.placement["memory_budget_bytes"],
            role=role,
            label=str(row.release),
        )
    return list(found.values())


def warm_copy(deployment: Deployment, agents: QuerySet[Agent]) -> Deployment | None:
    """An earlier placed deployment of the same release whose server still runs
    on a live agent: the deploy goes back to it."""
    return (
        deployment.release.deployments.exclude(pk=deployment.pk)
        .filter(agent__in=agents, unloaded__isnull=True, placement__isnull=False)
        .exclude(serving_id="")
        .order_by("-started", "-id")
        .first()
    )


def place_deployment(deployment: Deployment, agents: QuerySet[Agent]) -> str:
    """Place `deployment` on one of `agents` (the live ones) and record it;
    returns "" when it was placed or is deployed unplaced, else why nothing
    fits (the caller fails the deployment)."""
    agents = agents.filter(enrollment="enrolled").exclude(enrolled_devices=[])
    warm = warm_copy(deployment, agents)
    if warm is not None:
        do_place_deployment(
            deployment,
            actor=WORKER,
            agent=warm.agent,
            placement={**warm.placement, "stop_first": []},
            need_bytes=warm.memory_need_bytes,
            note=f"warm: its server on {warm.agent.name} still runs; no restart",
        )
        return ""
    release = deployment.release
    # The rollback's agent (its target's) first, then by name.
    ordered = sorted(agents, key=lambda a: (a.pk != deployment.agent_id, a.name))
    best: tuple[Agent, Placed, Need] | None = None
    refusals, unknown = [], False
    for agent in ordered:
        need = need_for(release, deployment, agent)
        if need is None:
            unknown = True
            break
        placed = place(_devices(agent), residents(agent, deployment), need)
        if not placed.ok:
            refusals.append(f"{agent.name}: {placed.reason}")
        elif best is None or len(placed.stopped) < len(best[1].stopped):
            best = (agent, placed, need)
            if not placed.stopped:
                break
    if unknown or not ordered:
        why = (
            "the release's weight size is not recorded"
            if unknown
            else "no live agent is enrolled with devices"
        )
        do_place_deployment(
            deployment,
            actor=WORKER,
            agent=deployment.agent,
            placement=None,
            need_bytes=0,
            note=f"not placed ({why}): the agent's whole machine",
        )
        return ""
    if best is None:
        return "no agent has room for it: " + "; ".join(refusals)
    agent, placed, need = best
    do_place_deployment(
        deployment,
        actor=WORKER,
        agent=agent,
        placement=placed.placement.model_dump(),
        need_bytes=need.bytes_per_device,
        note=_note(agent, placed),
        stopped=[r.deployment_id for r in placed.stopped],
    )
    return ""


def _devices(agent: Agent) -> list[Device]:
    """The enrolled devices, each with the free memory the latest beat reported."""
    free = {d["index"]: d.get("memory_free_bytes") for d in agent.devices}
    return [
        Device(
            d["index"],
            d["memory_total_bytes"],
            d.get("model", ""),
            free.get(d["index"]),
        )
        for d in agent.enrolled_devices
    ]


def _note(agent: Agent, placed: Placed) -> str:
    placement = placed.placement
    devices = ",".join(map(str, placement.devices))
    note = (
        f"on {agent.name} devices {devices}, "
        f"{placement.memory_budget_bytes / 2**30:.2f} GiB each"
    )
    if placed.stopped:
        stopped = ", ".join(
            f"{r.label} ({'served now: cold swap' if r.role == 'serving' else 'cold'})"
            for r in placed.stopped
        )
        note += f"; stopped first to make room: {stopped}"
    return note
