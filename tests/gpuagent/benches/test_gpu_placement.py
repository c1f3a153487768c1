"""The GPU placement check's CPU-side contract: where no CUDA device is visible it
measures nothing and says so (exit 2, never a pass)."""

import pytest
import torch

from gpuagent.benches import gpu_placement


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device answer")
def test_it_measures_nothing_without_a_device(capsys):
    assert gpu_placement.main([]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
