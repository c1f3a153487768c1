"""The HTTP-vs-in-process evaluation bench, one whole run on the demo model: the
like-for-like row first (the same numbers over HTTP as in process), the issue's
target judged, and no server left behind."""

import pytest

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches import http_eval as bench
from tests.gpuagent.serving_backends.conftest import processes_with


@pytest.mark.timeout(300)
def test_a_run_prints_the_like_for_like_row_first_and_judges_the_target(
    capsys, monkeypatch
):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the servers' torch refs

    status = bench.main(
        ["--model-dir", str(DEMO_MODEL_DIR), "--max-items", "1", "--budget-s", "240"]
    )

    out = capsys.readouterr().out
    table = out[out.index("comparison (left vs right)") :].splitlines()
    first, target = table[1].split(), table[2].split()
    assert table[1].startswith("overall top-20: in-process vs HTTP")
    assert first[first.index("HTTP") + 3] == "1.0000"  # the same KL over HTTP
    assert table[2].startswith("overall exact in-process vs HTTP top-20")
    assert float(target[target.index("top-20") + 3]) == pytest.approx(1, abs=0.05)
    assert "target: KLD within 5%" in out and status == 0
    assert processes_with("http-eval-") == []  # the candidate's server stopped
