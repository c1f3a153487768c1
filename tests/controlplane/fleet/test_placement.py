"""controlplane.fleet.placement, the pure function: devices and a budget for a
release beside the servers already on an agent, stopping rollback targets (then
the live one) only when both don't fit, never another environment's."""

import pytest

from controlplane.fleet.placement import (
    EXTERNAL_ACTIVATION_HEADROOM_BYTES,
    GIB,
    USABLE_FRACTION,
    Device,
    Need,
    Resident,
    memory_need,
    place,
)
from gpuagent.protocol import BackendSpec

H100 = 80 * GIB
USABLE = int(H100 * USABLE_FRACTION)


def devices(count: int, total: int = H100) -> list[Device]:
    return [Device(i, total, "NVIDIA H100") for i in range(count)]


def resident(n, devs, budget, role="serving") -> Resident:
    return Resident(n, f"srv-{n}", tuple(devs), budget, role, f"release {n}")


def test_it_gives_a_pair_on_one_agent_disjoint_devices():
    live = resident(1, [0], 40 * GIB)

    placed = place(devices(2), [live], Need(40 * GIB))

    assert placed.ok and placed.stopped == ()
    assert placed.placement.devices == [1]
    assert placed.placement.stop_first == []


def test_it_puts_a_pair_on_one_device_when_both_budgets_fit():
    live = resident(1, [0], 30 * GIB)

    placed = place(devices(1), [live], Need(30 * GIB))

    assert placed.ok and placed.stopped == ()
    assert placed.placement.devices == [0]
    assert placed.placement.memory_budget_bytes == 30 * GIB
    assert 30 * GIB + placed.placement.memory_budget_bytes <= USABLE
    assert placed.placement.device_memory_total_bytes == H100


def test_a_release_that_does_not_fit_beside_the_live_one_stops_it():
    live = resident(1, [0], 50 * GIB)

    placed = place(devices(1), [live], Need(50 * GIB))

    assert placed.ok and placed.stopped == (live,)  # a cold swap
    assert placed.placement.stop_first == ["srv-1"]


def test_it_stops_the_rollback_target_before_the_live_one():
    older = resident(1, [0], 30 * GIB, role="rollback")
    live = resident(2, [0], 30 * GIB)

    placed = place(devices(1), [older, live], Need(30 * GIB))

    assert placed.ok and placed.stopped == (older,)
    assert placed.placement.stop_first == ["srv-1"]


def test_it_stops_only_servers_on_the_devices_it_takes():
    older = resident(1, [1], 30 * GIB, role="rollback")  # on the other device
    live = resident(2, [0], 50 * GIB)
    other = resident(3, [1], 50 * GIB, role="other")

    placed = place(devices(2), [older, live, other], Need(50 * GIB))

    assert placed.placement.devices == [0]
    assert placed.stopped == (live,)
    assert placed.placement.stop_first == ["srv-2"]


def test_it_never_stops_another_environments_server_and_says_why():
    other = resident(1, [0], 60 * GIB, role="other")

    placed = place(devices(1), [other], Need(30 * GIB))

    assert not placed.ok and placed.placement is None
    assert "30.00 GiB on each of 1 device(s)" in placed.reason
    assert "other environments' servers hold 60.00 GiB" in placed.reason


def test_a_tensor_parallel_need_takes_as_many_devices():
    live = resident(1, [0, 1], 40 * GIB)

    placed = place(devices(4), [live], Need(40 * GIB, device_count=2))

    assert placed.placement.devices == [2, 3]
    too_many = place(devices(2), [], Need(GIB, device_count=4))
    assert not too_many.ok and "needs 4 devices" in too_many.reason


def test_it_takes_no_more_than_the_free_memory_the_agent_reported():
    # Something outside the control plane holds 50 GiB of the device.
    busy = Device(0, H100, "NVIDIA H100", memory_free_bytes=30 * GIB - 1)
    live = resident(1, [0], 10 * GIB)

    placed = place([busy], [live], Need(30 * GIB))

    # Not beside the live one (72 - 10 GiB would hold it by budgets alone);
    # stopping it frees its 10 GiB.
    assert placed.ok and placed.stopped == (live,)
    assert not place([busy], [], Need(40 * GIB)).ok


def test_no_enrolled_devices_places_nothing():
    placed = place([], [], Need(GIB))

    assert not placed.ok and "enrolled to use no devices" in placed.reason


def test_an_environments_memory_share_is_claimed_on_each_device():
    placed = place(devices(1), [], Need(GIB, fraction_of_total=0.5))

    assert placed.placement.memory_budget_bytes == 40 * GIB
    beside = place(devices(1), [resident(1, [0], 40 * GIB)], Need(GIB))
    assert beside.placement.memory_budget_bytes == GIB


@pytest.mark.parametrize(
    ("on_cpu", "weights", "factor"),
    [(False, "bf16", 1), (True, "bf16", 2), (True, "fp16", 1)],
)
def test_the_engine_needs_its_weights_and_kv_pool(on_cpu, weights, factor):
    need = memory_need(
        weights_bytes=10 * GIB,
        kv_bytes_per_token=1000,
        weights_format=weights,
        backend=BackendSpec(),
        on_cpu=on_cpu,
    )

    assert need.device_count == 1
    assert need.bytes_per_device == 10 * GIB * factor + int(0.05 * GIB)


def test_an_external_engine_needs_its_share_of_weights_one_context_and_headroom():
    backend = BackendSpec(
        kind="external", preset="vllm", tensor_parallel_size=4, max_model_len=4096
    )

    need = memory_need(
        weights_bytes=100 * GIB,
        kv_bytes_per_token=2**20,
        weights_format="w4a16-g128",
        backend=backend,
        on_cpu=False,
    )

    assert need.device_count == 4
    assert need.bytes_per_device == (
        25 * GIB + 4096 * 2**20 // 4 + EXTERNAL_ACTIVATION_HEADROOM_BYTES
    )
