"""Shared by the agent's tests (engine, models, evaluate, loadtest)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Run the agent's tests on one intra-op thread: the tiny matmuls here gain
    nothing from more, and on a shared CPU extra threads spin-wait and run 10-40x
    slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
