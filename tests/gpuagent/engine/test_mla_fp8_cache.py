"""MLA's int8 and fp8 latent caches (`gpuagent.engine.mla`): the latent c as int8
or e4m3 codes under a static per-layer scale, the RoPE key as int8 codes with a
float16 scale per token. What they store and read back, the bytes they take, and
the prefix cache on the trained MoE demo model: the same greedy tokens with the
cache on and off. (That they read what `benches.mla_kv` simulates, bit for bit, is
the bench's test; the kernel against the torch path, `tests/kernels/
test_mla_attention.py` and `test_moe_demo_model.py`.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpuagent.engine
import kernels
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.mla import (
    FP8_MAX,
    INT8_MAX,
    allocate_mla_cache,
    gather_latent,
    mla_kv_bytes_per_token,
    mla_kv_static_bytes,
    set_latent_scales,
    write_latent,
)
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.evaluate.evalsets import load_text_slices

MOE_DIR = Path(gpuagent.engine.__file__).parent / "moe_demo_model"
RANK, ROPE = 64, 16


@pytest.fixture(scope="module")
def moe_model():
    return load_model(MOE_DIR)


def written_cache(
    latent: torch.Tensor, scale: float, kv_dtype: str = "fp8", block_size: int = 4
):
    """An int8 or fp8 latent cache holding `latent` [n, RANK + ROPE] in reversed
    slots."""
    n = latent.shape[0]
    cache = allocate_mla_cache(kv_dtype, n // block_size + 2, block_size, RANK + ROPE)
    set_latent_scales(cache, torch.tensor([scale]))
    slots = torch.arange(n).flip(0) + block_size  # block 0 left empty
    write_latent(cache, latent, slots, RANK)
    return cache, slots


def latent_and_rope_key(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """c [n, RANK] ~ N(0, 1), k_pe [n, ROPE] whose range grows token by token."""
    g = torch.Generator().manual_seed(0)
    c = torch.randn(n, RANK, generator=g)
    k_pe = 4 * torch.randn(n, ROPE, generator=g) * torch.arange(1, n + 1)[:, None]
    return c, k_pe


def test_it_reads_the_latent_as_e4m3_and_the_rope_key_as_int8_per_token():
    c, k_pe = latent_and_rope_key()
    scale = float(c.abs().max()) / FP8_MAX
    cache, slots = written_cache(torch.cat((c, k_pe), -1), scale)

    latents, valid = gather_latent(
        cache, torch.arange(cache.num_blocks, dtype=torch.int32)[None],
        torch.tensor([cache.num_slots]), RANK,
    )  # fmt: skip
    read = latents[0, slots]

    assert valid.all()
    want_c = (c / scale).to(torch.float8_e4m3fn).float() * scale
    codes, pe_scale = kernels.quantize_kv(k_pe, "int8")
    assert torch.equal(read[:, :RANK], want_c)
    assert torch.equal(read[:, RANK:], kernels.dequantize_kv(codes, pe_scale, "int8"))
    assert torch.equal(cache.rope_scale.view(-1)[slots], pe_scale)
    # each token's RoPE key keeps its own range: within half an int8 step of it
    step = k_pe.abs().amax(-1, keepdim=True) / 127
    assert ((read[:, RANK:] - k_pe).abs() <= step / 2 * (1 + 1e-3)).all()
    # e4m3 on c: within 1/16 of each value (3 mantissa bits), none clipped
    assert ((read[:, :RANK] - c).abs() <= c.abs() / 16 + 2**-10 * scale).all()


def test_it_reads_the_latent_as_int8_under_its_static_scale():
    c, k_pe = latent_and_rope_key()
    scale = float(c.abs().max()) / INT8_MAX * 0.9  # the largest values clip
    cache, slots = written_cache(torch.cat((c, k_pe), -1), scale, "int8")

    latents, _ = gather_latent(
        cache, torch.arange(cache.num_blocks, dtype=torch.int32)[None],
        torch.tensor([cache.num_slots]), RANK,
    )  # fmt: skip
    read = latents[0, slots]

    codes = torch.floor(c / scale + 0.5).clamp(-127, 127)
    assert cache.key.dtype == torch.int8
    assert torch.equal(read[:, :RANK], codes * torch.tensor(scale))
    pe_codes, pe_scale = kernels.quantize_kv(k_pe, "int8")
    assert torch.equal(
        read[:, RANK:], kernels.dequantize_kv(pe_codes, pe_scale, "int8")
    )
    assert torch.equal(cache.rope_scale.view(-1)[slots], pe_scale)
    # inside the range: within half a step of c; beyond it: the outer level
    inside = c.abs() <= 127 * scale
    err = (read[:, :RANK] - c).abs()
    assert (err[inside] <= scale / 2 * (1 + 1e-4)).all() and (~inside).any()
    outer = 127 * torch.tensor(scale)
    assert (read[:, :RANK][~inside].abs() == outer).all()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_it_takes_the_bytes_it_counts(kv_dtype):
    config = load_model(MOE_DIR).config  # 4 layers, rank 64 + rope 16
    cache = allocate_mla_cache(kv_dtype, 5, 4, RANK + ROPE)

    per_layer = RANK + ROPE + 2  # codes, the RoPE key's float16 scale
    assert mla_kv_bytes_per_token(config, kv_dtype) == 4 * per_layer
    assert mla_kv_static_bytes(config, kv_dtype) == 4 * 4  # a float32 per layer
    assert cache.nbytes == per_layer * cache.num_slots + 4
    ratio = mla_kv_bytes_per_token(config, kv_dtype) / mla_kv_bytes_per_token(
        config, "bf16"
    )
    assert ratio == 82 / 160


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_it_refuses_a_write_before_its_scale(kv_dtype):
    cache = allocate_mla_cache(kv_dtype, 2, 4, RANK + ROPE)

    with pytest.raises(ValueError, match=f"an {kv_dtype} latent cache needs"):
        write_latent(cache, torch.ones(1, RANK + ROPE), torch.tensor([0]), RANK)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_it_refuses_a_scale_pair_now_that_the_rope_key_is_per_token(kv_dtype):
    cache = allocate_mla_cache(kv_dtype, 2, 4, RANK + ROPE)

    with pytest.raises(ValueError, match=r"latent scale must be \[1\]"):
        set_latent_scales(cache, torch.tensor([0.01, 0.04]))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_it_gives_the_same_greedy_tokens_with_the_prefix_cache_on_and_off(
    moe_model, kv_dtype
):
    english, code, korean = (s.passages for s in load_text_slices())
    system = english[0][:300] + "\n\n"
    prompts = [system + text[:80] for text in (english[1], code[0], korean[0])]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def serve(caching: bool) -> tuple[list, list, LLMEngine]:
        engine = LLMEngine(
            moe_model,
            load_tokenizer(MOE_DIR),
            kv_cache_dtype=kv_dtype,
            num_blocks=96,
            block_size=16,
            max_num_batched_tokens=128,
            enable_prefix_caching=caching,
            prepack_weights=False,
        )
        first = engine.generate(prompts, params)
        turns = zip(prompts, first, strict=True)
        again = [p + o.text + "\n" + english[2][:40] for p, o in turns]
        second = engine.generate(again, params)
        return first, second, engine

    off_first, off_second, _ = serve(caching=False)
    on_first, on_second, engine = serve(caching=True)

    assert [o.token_ids for o in on_first] == [o.token_ids for o in off_first]
    assert [o.token_ids for o in on_second] == [o.token_ids for o in off_second]
    assert all(o.num_cached_tokens == 0 for o in off_first + off_second)
    # every second turn started from its first turn's cached blocks
    assert all(o.num_cached_tokens >= 16 for o in on_second)
    assert engine.kv.window == 0  # no bf16 window: nothing to refill
    assert all(c.scales_set for c in engine.kv.kv_caches)  # calibrated at start
