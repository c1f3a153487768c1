"""The int8 head candidates bench: every candidate computes the same head (within
its own rounding) at decode and above the kernel's rows, and the table prints."""

import pytest
import torch

from gpuagent.benches.head_kernels import candidates, main
from kernels import int8_cpu


@pytest.mark.parametrize("rows", [1, int8_cpu.MAX_ROWS + 1])
def test_every_candidate_computes_the_head(rows):
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    want = x @ w.t()

    calls = candidates(w, rows)

    assert len(calls) == 5
    for name, call in calls.items():
        got = call().float()
        assert got.shape == want.shape, name
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), name


def test_it_prints_one_line_per_candidate_and_shape(capsys):
    main(
        [
            "--n",
            "64",
            "--k",
            "32",
            "--rows",
            "1",
            "2",
            "--threads",
            "1",
            "--rounds",
            "1",
        ]
    )

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 2 * 5
    assert all("x float32" in line for line in lines[1:])
