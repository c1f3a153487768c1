"""What `kv_cache_dtype="fp8"` serves (the static-scale, rotated layout with its
window; the per-token layout only under its explicit name), fp8 scales carried by a
checkpoint (vLLM's k_scale / v_scale), and prefill logprobs that don't depend on where
the chunks end when a full-precision window sits beside a quantized cache."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels
from gpuagent import protocol
from gpuagent.benches import engine as bench
from gpuagent.engine.engine import LLMEngine, default_kv_window
from gpuagent.engine.kv_calibration import calibration_sequences, static_kv_scales
from gpuagent.engine.loader import ModelLoadError, load_model
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.evaluate.evalsets import load_text_slices
from tests.gpuagent.engine.conftest import make_tiny_model_dir


def test_the_protocol_offers_every_servable_kv_dtype_of_the_kernels():
    # fp32 is for parity checks only; int4c is served since the paged attention
    # kernels read it (engine.kv_int4c writes it)
    servable = tuple(d for d in kernels.KV_CACHE_DTYPES if d != "fp32")
    assert sorted(protocol.KV_CACHE_DTYPES) == sorted(servable)
    assert "int4c" in protocol.KV_CACHE_DTYPES
    assert "fp8-per-token" in protocol.KV_CACHE_DTYPES


def test_fp8_serves_calibrated_static_scales_rotated_with_a_window(
    tiny_model_and_tokenizer,
):
    model, tokenizer = tiny_model_and_tokenizer
    fp8 = LLMEngine(
        model, tokenizer, kv_cache_dtype="fp8", num_blocks=4, prepack_weights=False
    )
    per_token = LLMEngine(
        model,
        tokenizer,
        kv_cache_dtype="fp8-per-token",
        num_blocks=4,
        prepack_weights=False,
    )

    for cache in fp8.kv.kv_caches:
        assert cache.static_scales and cache.scales_set and cache.rotated
        assert cache.key_scale.shape == (model.config.num_key_value_heads,)
        assert cache.window == default_kv_window("fp8") == 16
    for cache in per_token.kv.kv_caches:
        assert not cache.static_scales and not cache.rotated and cache.window == 0
        assert cache.key_scale.shape[:2] == (4, 16)  # one scale per token slot


def write_kv_scales(model_dir, scales) -> None:
    """Add `model.layers.N.self_attn.{k,v}_scale` tensors to the checkpoint."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors.update(scales)
    save_file(tensors, path, metadata={"format": "pt"})


def test_fp8_uses_the_checkpoints_kv_scales_instead_of_calibrating(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "m")  # 2 layers, 1 kv head
    scales = {}
    for layer in range(2):
        scales[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.02 + layer)
        scales[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.03])
    write_kv_scales(model_dir, scales)

    model = load_model(model_dir)
    engine = LLMEngine(
        model,
        load_tokenizer(model_dir),
        kv_cache_dtype="fp8",
        num_blocks=4,
        prepack_weights=False,
    )

    for layer, cache in enumerate(engine.kv.kv_caches):
        # unrotated: the checkpoint's scales were computed on unrotated K/V
        assert not cache.rotated and cache.scales_set
        assert cache.key_scale.tolist() == pytest.approx([0.02 + layer])
        assert cache.value_scale.tolist() == pytest.approx([0.03])
    out = engine.generate(["hello"], SamplingParams(max_tokens=3))[0]
    assert len(out.token_ids) == 3
    # other layouts ignore them (they carry their own scales)
    int8 = LLMEngine(
        model,
        load_tokenizer(model_dir),
        kv_cache_dtype="int8",
        num_blocks=4,
        prepack_weights=False,
    )
    assert all(c.rotated for c in int8.kv.kv_caches)


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        ({"model.layers.0.self_attn.k_scale": torch.tensor(0.1)}, "lacks"),
        (
            {
                f"model.layers.{i}.self_attn.{kind}": torch.tensor(-1.0)
                for i in range(2)
                for kind in ("k_scale", "v_scale")
            },
            "positive",
        ),
        ({"model.layers.7.self_attn.k_scale": torch.tensor(0.1)}, "names no"),
        (
            {
                f"model.layers.{i}.self_attn.{kind}": torch.ones(3)
                for i in range(2)
                for kind in ("k_scale", "v_scale")
            },
            "need 1 or 1",
        ),
    ],
)
def test_bad_checkpoint_kv_scales_are_refused_by_name(tmp_path, scales, message):
    model_dir = make_tiny_model_dir(tmp_path / "m")
    write_kv_scales(model_dir, scales)

    with pytest.raises(ModelLoadError, match=message):
        load_model(model_dir)


@pytest.fixture(scope="module")
def demo_model_and_tokenizer():
    return load_model(bench.DEMO_MODEL_DIR), load_tokenizer(bench.DEMO_MODEL_DIR)


@pytest.mark.parametrize("kv_dtype", ["int4", "fp8"])
def test_windowed_prefill_logprobs_do_not_depend_on_the_chunks(
    demo_model_and_tokenizer, kv_dtype
):
    # Each query reads the W tokens before it in full precision, whatever chunk it
    # comes in: a 600-token prompt prefilled in chunks of 512, 256 or 97 gives the
    # same logprobs (before, the queries of a chunk shared the window of its end:
    # up to 0.25 nats apart).
    model, tokenizer = demo_model_and_tokenizer
    text = " ".join(p for s in load_text_slices() for p in s.passages)
    ids = tokenizer.encode_prompt(text)[:600]
    assert len(ids) == 600
    scales = None
    if kv_dtype == "fp8":
        scales = static_kv_scales(model, calibration_sequences(tokenizer))

    runs = {
        chunk: bench.teacher_forced_logprobs(
            model, ids, kv_dtype, chunk_tokens=chunk, static_scales=scales
        )
        for chunk in (512, 256, 97)
    }

    # Another chunking is another float32 summation order for the K/V the cache
    # quantizes, which now and then puts a value on the other side of an int4
    # rounding step: up to 1.05e-4 nats measured (on an AMX Xeon; < 1e-4 on others).
    for chunk in (256, 97):
        diff = (runs[chunk] - runs[512]).abs().max().item()
        assert diff < 1e-3, (chunk, diff)
    # and the window matters: the quantized cache differs from bf16 KV (0.47 nats
    # for fp8, 1.2 for int4 measured)
    bf16 = bench.teacher_forced_logprobs(model, ids, "bf16", chunk_tokens=512)
    assert (runs[512] - bf16).abs().max().item() > 0.1
