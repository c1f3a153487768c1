"""The llama.cpp decode bench without its optional peer: the row is skipped with a
message saying how to get it, our side still measured; no test needs node-llama-cpp.
The like-for-like head precision is read from the GGUF."""

import numpy as np
import pytest

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches.engine import Row
from gpuagent.benches.llamacpp import (
    GET_PEER,
    LlamaCppPeer,
    PeerUnavailable,
    common_prefix,
    decode_rows,
    gguf_head_format,
    head_threads_rows,
    long_prompt,
    peer_missing,
    w4a16_folder,
)


def test_an_absent_peer_is_named_with_how_to_get_it(tmp_path):
    missing = peer_missing(tmp_path)
    assert missing is not None and "skipped" in missing
    with pytest.raises(PeerUnavailable, match="skipped"):
        LlamaCppPeer(tmp_path / "model.gguf", 2, peer_dir=tmp_path)


def test_without_the_peer_our_rows_are_measured_and_nothing_is_judged(tmp_path):
    from gpuagent.models.smollm2 import gguf_path

    rows = decode_rows(DEMO_MODEL_DIR, gguf_path(), 1, 3, 1, peer_dir=tmp_path / "none")
    judged = [r for r in rows if isinstance(r, Row)]
    assert {r.ok for r in judged} == {None}
    speeds = [r for r in judged if " decode tok/s " in r.name]
    same = judged[-1]
    assert all(float(r.value) > 0 for r in speeds)
    # the demo model is float: its layers run in torch, said so
    (one_call,) = [r for r in judged if "one call each" in r.name]
    assert one_call.value == "no"
    # like-for-like first: the GGUF's Q8_0 head is our int8 copy; then the float
    assert speeds[0].name.startswith("ours, int8 head (Q8_0) decode tok/s")
    assert speeds[1].name.startswith("ours, float32 head decode tok/s")
    assert "float head's" in same.name and same.value.endswith("/3")
    assert rows[-1] == peer_missing(tmp_path / "none")
    assert "skipped" in rows[-1] and "make llama-cpp-peer" in GET_PEER
    # the demo model is float: no int4 weights for int8 activations, said so
    assert "int8 activations skipped" in rows[-2] and "int4 weights" in rows[-2]


def test_the_like_for_like_head_can_come_with_the_release(tmp_path):
    from gpuagent.models.smollm2 import gguf_path

    plain = w4a16_folder(DEMO_MODEL_DIR, tmp_path / "plain")
    with_head = w4a16_folder(DEMO_MODEL_DIR, tmp_path / "head", head="int8")

    rows = decode_rows(
        plain, gguf_path(), 1, 3, 1, peer_dir=tmp_path / "none", head_folder=with_head
    )

    assert rows[0].endswith("ours from the recipe option head='int8'")
    judged = [r for r in rows if isinstance(r, Row)]
    assert judged[0].name.startswith("ours, int8 head (Q8_0) decode tok/s")
    # then the same release with int8 activations, and its quality cost last
    assert judged[1].name.startswith(
        "ours, int8 head (Q8_0), int8 activations decode tok/s"
    )
    speeds = [r for r in judged if " decode tok/s " in r.name]
    assert all(float(r.value) > 0 for r in speeds)
    (one_call,) = [r for r in judged if "one call each" in r.name]
    assert one_call.value == "yes"  # int4 weights: kernels.int4_layer ran
    agree, kld, top1 = judged[-3:]
    assert agree.name.startswith(
        "greedy tokens of ours, int8 head (Q8_0), int8 activations equal to float"
    )
    assert agree.value.endswith("/3")
    assert 0 < float(kld.value) < 0.05 and "mean KLD" in kld.name
    assert top1.value.endswith("%") and float(top1.value[:-1]) >= 80
    config = (with_head / "config.json").read_text()
    assert (
        '"re:^lm_head$"' in config
        and "re:^lm_head$" not in (plain / "config.json").read_text()
    )


def test_common_prefix_counts_leading_agreement():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([7], [8]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_the_head_threads_rows_time_both_and_compare_tokens():
    rows = head_threads_rows(DEMO_MODEL_DIR, 2, 3, 1)
    old, new = (float(v) for v in rows[0].value.split("/"))
    assert old > 0 and new > 0
    assert rows[1].value.endswith("True")  # same greedy tokens


def test_the_head_precision_is_read_from_the_gguf(tmp_path):
    import gguf

    from gpuagent.models.smollm2 import gguf_path

    assert gguf_head_format(gguf_path()) == ("Q8_0", "int8")

    def written(name, tensors):
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        for tensor_name, array in tensors.items():
            writer.add_tensor(tensor_name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / name

    embed = np.zeros((8, 4), np.float32)
    # an untied output head wins over the embedding
    untied = written("untied.gguf", {"token_embd.weight": embed.astype(np.float16),
                                     "output.weight": embed})  # fmt: skip
    assert gguf_head_format(untied) == ("F32", None)
    half = written("f16.gguf", {"token_embd.weight": embed.astype(np.float16)})
    with pytest.raises(ValueError, match="token_embd.weight is F16; no head format"):
        gguf_head_format(half)
    headless = written("none.gguf", {"blk.0.attn_norm.weight": embed[0]})
    with pytest.raises(ValueError, match="neither output.weight nor token_embd"):
        gguf_head_format(headless)


def test_a_long_prompt_is_held_out_text_and_both_sides_decode_after_it(tmp_path):
    from gpuagent.engine.tokenizer import load_tokenizer
    from gpuagent.evaluate.evalsets import load_heldout_passages
    from gpuagent.models.smollm2 import gguf_path

    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    ids = long_prompt(tokenizer, 300)
    first = load_heldout_passages()[0].text
    assert len(ids) == 300 and ids == tokenizer.encode_prompt(first)[:300]
    with pytest.raises(ValueError, match="--prompt-tokens 10000000: the held-out"):
        long_prompt(tokenizer, 10**7)

    rows = decode_rows(
        DEMO_MODEL_DIR, gguf_path(), 1, 3, 1, peer_dir=tmp_path, prompt_tokens=300
    )
    assert ", prompt 300 tokens, 3 new," in rows[0]
    speeds = [r for r in rows if isinstance(r, Row) and " decode tok/s " in r.name]
    assert speeds and all(float(r.value) > 0 for r in speeds)
