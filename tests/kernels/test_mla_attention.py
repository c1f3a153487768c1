"""kernels.mla_attention: absorbed MLA decode over the paged latent cache.

The caches are written by the engine's own writer (`gpuagent.engine.mla`), so the
kernel reads the layout the engine stores. The reference is checked against a slow
float64 loop over tokens that reads the cache through the engine's reader
(`gather_latent`); the Triton kernel (interpreted) is checked against the reference
for every KV dtype the latent cache supports, on shuffled physical blocks, sequences
of different lengths crossing block boundaries, partially filled last blocks, head
counts that are not a multiple of the kernel's head group, and latent widths that
are not powers of two.
"""

import math

import pytest
import torch

import kernels
from gpuagent.engine.mla import (
    MLA_KV_DTYPES,
    allocate_mla_cache,
    gather_latent,
    set_latent_scales,
    write_latent,
)
from kernels import mla_attention
from kernels.mla_attention import mla_decode_attention_reference
from tests.kernels.compile_helper import compile_for_sm90

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (rank, rope, num_heads, block_size): the demo model's latent (64 + 16, 4 heads);
# widths that are no powers of two (48 + 8, padded in the kernel) with 20 heads,
# two head groups of 16 with 12 padding rows.
SHAPES = [(64, 16, 4, 4), (48, 8, 20, 8)]
# (1 token, a partial block, several full blocks plus a partial one, whole blocks)
CONTEXT_LENS = [1, 9, 23, 16]
# DeepSeek-V3's scale: (nope 128 + rope 64)^-1/2 times YaRN's mscale^2 (factor 40,
# mscale_all_dim 1), as `MoEConfig.softmax_scale` computes it
SOFTMAX_SCALE = 192**-0.5 * (0.1 * math.log(40) + 1.0) ** 2
# Interpreted kernel vs reference, float32 on both sides from the same codes and
# scales: the kernel sums in another order (tiles of 16 tokens, the online
# softmax's rescaling) and multiplies a token's scales on its score and
# probability instead of on each element, a few float32 ulps of the outputs
# (|out| <= ~3): measured at most 1.7e-6 over these tests. 1e-5 is 5x that, and
# 1000x below what one int8 code step of a latent (absmax / 127) would move.
ATOL = RTOL = 1e-5
# On CUDA the dots round their operands to TF32 (10-bit mantissa) unless the cache
# is fp32 (IEEE dots), as the Llama decode; not yet measured on a GPU.
CUDA_TOLERANCE = {d: (5e-3, 5e-3) for d in MLA_KV_DTYPES} | {"fp32": (1e-4, 1e-4)}


def filled_latent_cache(dtype, rank, rope, block_size, context_lens, seed=0):
    """A latent cache holding random rows for each sequence in shuffled physical
    blocks, written by the engine's `write_latent` (int8 and fp8: the latent's
    static scale first); tables padded with -1 past each sequence's blocks, plus
    spare blocks.

    Returns (cache, block_tables [B, max_blocks] int32, context_lens [B] int32)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    cache = allocate_mla_cache(dtype, num_blocks, block_size, rank + rope)
    if cache.static_scales:  # the latent's: |c| ~ 4.5 at most, unclipped
        set_latent_scales(cache, torch.tensor([0.01 if dtype == "fp8" else 0.04]))
    pool = torch.randperm(num_blocks, generator=g).tolist()
    width = max(max(blocks_per_seq), 1)
    tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    for b, n in enumerate(context_lens):
        mine = torch.tensor([pool.pop() for _ in range(blocks_per_seq[b])])
        tables[b, : len(mine)] = mine.to(torch.int32)
        pos = torch.arange(n)
        slots = mine[pos // block_size] * block_size + pos % block_size
        # a RoPE key larger than the normed latent, as in the models
        latent = torch.cat(
            (torch.randn(n, rank, generator=g), 4 * torch.randn(n, rope, generator=g)),
            dim=-1,
        )
        write_latent(cache, latent, slots.long(), rank)
    return cache, tables, torch.tensor(context_lens, dtype=torch.int32)


def queries(batch, num_heads, rank, rope, seed=1):
    g = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(batch, num_heads, rank, generator=g)
    return q_lat, torch.randn(batch, num_heads, rope, generator=g)


@pytest.mark.parametrize("dtype", list(MLA_KV_DTYPES))
def test_it_decodes_like_a_slow_loop_over_the_engines_gathered_latents(dtype):
    rank, rope, num_heads, block_size = SHAPES[1]
    cache, tables, lens = filled_latent_cache(
        dtype, rank, rope, block_size, CONTEXT_LENS
    )
    q_lat, q_pe = queries(len(CONTEXT_LENS), num_heads, rank, rope)

    out = mla_decode_attention_reference(
        q_lat, q_pe, cache, tables, lens, SOFTMAX_SCALE
    )

    for b, n in enumerate(CONTEXT_LENS):
        latents, _ = gather_latent(cache, tables[b : b + 1], lens[b : b + 1], rank)
        c, k_pe = latents[0].double().split((rank, rope), dim=-1)  # [n, *]
        for h in range(num_heads):
            qc, qp = q_lat[b, h].double(), q_pe[b, h].double()
            scores = torch.stack([qc @ c[j] + qp @ k_pe[j] for j in range(n)])
            probs = (SOFTMAX_SCALE * scores).softmax(0)
            want = (probs[:, None] * c).sum(0)
            torch.testing.assert_close(out[b, h].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", list(MLA_KV_DTYPES))
def test_it_decodes_with_triton_like_the_reference(dtype, shape):
    rank, rope, num_heads, block_size = shape
    cache, tables, lens = filled_latent_cache(
        dtype, rank, rope, block_size, CONTEXT_LENS
    )
    q_lat, q_pe = queries(len(CONTEXT_LENS), num_heads, rank, rope)

    want = kernels.mla_decode_attention(
        q_lat, q_pe, cache, tables, lens, SOFTMAX_SCALE, impl="reference"
    )
    got = kernels.mla_decode_attention(
        q_lat, q_pe, cache, tables, lens, SOFTMAX_SCALE, impl="triton"
    )

    assert got.shape == (len(CONTEXT_LENS), num_heads, rank)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp8-per-token", "fp8"])
def test_it_merges_context_partitions_including_empty_ones(dtype):
    # partitions of 32 tokens: 70 spans three, 33 two (the second holds one token),
    # 5 one and two empty ones (the table is as wide as the longest sequence)
    rank, rope, num_heads, block_size = SHAPES[0]
    cache, tables, lens = filled_latent_cache(
        dtype, rank, rope, block_size, [70, 5, 33], seed=3
    )
    q_lat, q_pe = queries(3, num_heads, rank, rope, seed=4)

    want = mla_decode_attention_reference(
        q_lat, q_pe, cache, tables, lens, SOFTMAX_SCALE
    )
    got = mla_attention._mla_decode_triton(
        q_lat, q_pe, cache, tables, lens, SOFTMAX_SCALE, partition_size=32
    )

    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_it_returns_zeros_for_a_sequence_with_no_context(impl):
    cache, tables, lens = filled_latent_cache("int8", 64, 16, 4, [6, 3])
    lens[1] = 0
    q_lat, q_pe = queries(2, 4, 64, 16)

    out = kernels.mla_decode_attention(q_lat, q_pe, cache, tables, lens, 0.1, impl=impl)

    assert torch.isfinite(out).all()
    assert out[1].abs().max().item() == 0.0 and out[0].abs().max().item() > 0.0


def test_it_keeps_the_query_dtype():
    cache, tables, lens = filled_latent_cache("bf16", 64, 16, 4, [6])
    q_lat, q_pe = (q.bfloat16() for q in queries(1, 4, 64, 16))

    got = kernels.mla_decode_attention(
        q_lat, q_pe, cache, tables, lens, 0.1, impl="triton"
    )
    want = mla_decode_attention_reference(q_lat, q_pe, cache, tables, lens, 0.1)

    assert got.dtype == want.dtype == torch.bfloat16
    # both round the same float32 result to bf16: at most one bf16 step apart
    torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)


def test_it_refuses_int4_and_a_llama_cache_by_name():
    q_lat, q_pe = queries(1, 4, 64, 16)
    tables, lens = (
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
    )
    int4 = kernels.allocate_kv_cache("int4", 2, 4, 1, 80)
    llama = kernels.allocate_kv_cache("bf16", 2, 4, 1, 80)

    with pytest.raises(ValueError, match="'int4' is not supported for MLA"):
        kernels.mla_decode_attention(q_lat, q_pe, int4, tables, lens, 0.1)
    with pytest.raises(ValueError, match="not an MLA latent cache"):
        kernels.mla_decode_attention(q_lat, q_pe, llama, tables, lens, 0.1)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_it_rejects_mismatched_shapes_and_dtypes(impl):
    cache, tables, lens = filled_latent_cache("bf16", 64, 16, 4, [6, 3])
    q_lat, q_pe = queries(2, 4, 64, 16)

    with pytest.raises(ValueError, match="RANK 48 \\+ ROPE 16"):
        kernels.mla_decode_attention(
            q_lat[..., :48], q_pe, cache, tables, lens, 0.1, impl=impl
        )
    with pytest.raises(ValueError, match="batch size"):
        kernels.mla_decode_attention(
            q_lat, q_pe, cache, tables[:1], lens, 0.1, impl=impl
        )
    with pytest.raises(ValueError, match="share a bf16/fp16/fp32 dtype"):
        kernels.mla_decode_attention(
            q_lat, q_pe.double(), cache, tables, lens, 0.1, impl=impl
        )
    if impl == "triton":
        with pytest.raises(ValueError, match="block_tables must be int32"):
            kernels.mla_decode_attention(
                q_lat, q_pe, cache, tables.long(), lens, 0.1, impl=impl
            )


@needs_cuda
@pytest.mark.parametrize("dtype", list(MLA_KV_DTYPES))
def test_it_decodes_like_the_reference_on_cuda_at_deepseek_v3_shapes(dtype):
    # DeepSeek-V3: kv_lora_rank 512, rope 64, 128 heads; 3 partitions of 512
    cache, tables, lens = filled_latent_cache(dtype, 512, 64, 16, [1100, 37, 512])
    cache.key = cache.key.cuda()
    if cache.key_scale is not None:
        cache.key_scale = cache.key_scale.cuda()
    if cache.rope_scale is not None:
        cache.rope_scale = cache.rope_scale.cuda()
    q_lat, q_pe = (q.cuda() for q in queries(3, 128, 512, 64))

    got = kernels.mla_decode_attention(
        q_lat, q_pe, cache, tables.cuda(), lens.cuda(), SOFTMAX_SCALE
    )
    want = kernels.mla_decode_attention(
        q_lat, q_pe, cache, tables.cuda(), lens.cuda(), SOFTMAX_SCALE, impl="reference"
    )

    atol, rtol = CUDA_TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_it_compiles_the_kernel_for_sm90_without_a_gpu():
    result = compile_for_sm90("mla_attention")

    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
