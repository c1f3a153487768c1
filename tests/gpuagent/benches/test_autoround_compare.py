"""The AutoRound comparison bench's code path on the demo model with a tiny
budget: AutoRound runs in its own virtualenv (var/autoround-venv, made by
`python -m gpuagent.benches.autoround_compare --setup`), so this runs only where
that exists; the converter it relies on is tested without it
(tests/gpuagent/compress/test_gptq_convert.py)."""

from __future__ import annotations

import pytest

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches import autoround_compare as bench

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (bench.DEFAULT_VENV / "bin" / "python").exists(),
        reason=f"{bench.DEFAULT_VENV} not created (the bench's --setup)",
    ),
]


def test_autoround_row_comes_first_beside_ours(capsys):
    status = bench.main(
        [
            "--model-dir",
            str(DEMO_MODEL_DIR),
            "--sequences",
            "4",
            "--tokens",
            "64",
            "--steps",
            "2",
            "--max-items",
            "1",
            "--recipes",
            "signround",
        ]
    )

    out = capsys.readouterr().out
    table = out[out.index("recipe ") :].splitlines()
    assert table[1].startswith("AutoRound (sym)") and table[2].startswith("signround")
    for row in table[1:3]:
        linear = float(row.split()[-8])  # then KLD overall, 4 slices, top-1, s
        assert 0.2 < linear <= bench.SIZE_TARGET, row
    assert "g128 sym: ours best 'signround'" in out
    assert status in (0, 1)
