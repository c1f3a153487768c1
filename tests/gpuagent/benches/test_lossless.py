"""gpuagent.benches.lossless: rows from one run, no timing asserted."""

import time

from gpuagent.benches.lossless import (
    DEMO_MODEL_DIR,
    MAX_REPEATS,
    format_rows,
    lossless_rows,
)


def test_it_compares_both_coders_on_the_same_tensors():
    (row,) = lossless_rows([DEMO_MODEL_DIR], threads=1, repeats=1)

    assert row.model == "demo_model" and row.tensors == 38
    assert row.bf16_bytes == 6_431_232
    # both coders code the exponent: about two thirds of the bf16 bytes
    assert 0.6 < row.ours_fraction < 0.7 and 0.6 < row.zipnn_fraction < 0.7
    assert row.size_vs_zipnn == row.ours_fraction / row.zipnn_fraction
    assert min(row.ours_decompress_gbps, row.zipnn_decompress_gbps) > 0
    assert row.turns == 1
    assert "demo_model" in format_rows([row], threads=1)


def test_it_takes_more_turns_while_they_add_up_to_under_min_seconds():
    start = time.perf_counter()
    (row,) = lossless_rows([DEMO_MODEL_DIR], threads=1, repeats=1, min_seconds=0.5)
    elapsed = time.perf_counter() - start

    # each turn codes the demo model's 6.4 MB five times: well under 0.5 s
    assert 1 < row.turns <= MAX_REPEATS
    assert elapsed >= 0.5 or row.turns == MAX_REPEATS
