"""Dashboard fixtures on top of the shared cast (tests/controlplane/conftest.py):
`agent`, releases with recorded evidence (builders.py), and one that went live."""

import pytest

from controlplane.fleet.actions import do_register_agent
from tests.controlplane.dashboard.builders import take_live, to_awaiting_approval

GPU_MEMORY_BYTES = 80 * 2**30


@pytest.fixture
def agent(db):
    return do_register_agent(
        "gpu-a1",
        queue="agent.gpu-a1",
        gpu_model="NVIDIA H100 80GB HBM3",
        gpu_memory_bytes=GPU_MEMORY_BYTES,
    )


class QueuedDeployments:
    """deploys() -> the args of each deployment task queued through the outbox (not
    run), oldest first, since the last deploys.clear()."""

    def __init__(self, queued):
        self._queued = queued
        self._seen = 0

    def __call__(self) -> list[tuple]:
        return self._queued("run_deployment")[self._seen :]

    def clear(self) -> None:
        self._seen = len(self._queued("run_deployment"))


@pytest.fixture
def deploys(queued) -> QueuedDeployments:
    return QueuedDeployments(queued)


@pytest.fixture
def awaiting(make_release, agent):
    """make(version=None, **builder options): a release with evidence, waiting for
    an approver."""

    def make(version=None, **options):
        return to_awaiting_approval(make_release(version), agent=agent, **options)

    return make


@pytest.fixture
def make_live(awaiting, teammate, agent, deploys):
    """make(version=None, **builder options): approved by the teammate and live in
    the team's environment on `agent`."""

    def make(version=None, **options):
        return take_live(awaiting(version, **options), teammate, agent=agent)

    return make
