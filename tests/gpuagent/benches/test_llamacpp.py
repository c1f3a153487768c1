"""The llama.cpp decode bench without its optional peer: the row is skipped with a
message saying how to get it, our side still measured; no test needs node-llama-cpp."""

import pytest

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches.engine import Row
from gpuagent.benches.llamacpp import (
    GET_PEER,
    LlamaCppPeer,
    PeerUnavailable,
    common_prefix,
    decode_rows,
    head_threads_rows,
    peer_missing,
)


def test_an_absent_peer_is_named_with_how_to_get_it(tmp_path):
    missing = peer_missing(tmp_path)
    assert missing is not None and "skipped" in missing
    with pytest.raises(PeerUnavailable, match="skipped"):
        LlamaCppPeer(tmp_path / "model.gguf", 2, peer_dir=tmp_path)


def test_without_the_peer_our_row_is_measured_and_nothing_is_judged(tmp_path):
    rows = decode_rows(
        DEMO_MODEL_DIR, tmp_path / "x.gguf", 1, 3, 1, peer_dir=tmp_path / "none"
    )
    judged = [r for r in rows if isinstance(r, Row)]
    assert {r.ok for r in judged} == {None}
    assert all(float(r.value) > 0 for r in judged)
    assert judged[0].name.startswith("ours (w4a16-g128)")
    assert rows[-1] == peer_missing(tmp_path / "none")
    assert "skipped" in rows[-1] and "make llama-cpp-peer" in GET_PEER


def test_common_prefix_counts_leading_agreement():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([7], [8]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_the_head_threads_rows_time_both_and_compare_tokens():
    rows = head_threads_rows(DEMO_MODEL_DIR, 2, 3, 1)
    old, new = (float(v) for v in rows[0].value.split("/"))
    assert old > 0 and new > 0
    assert rows[1].value.endswith("True")  # same greedy tokens
