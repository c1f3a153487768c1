"""kernels.kv_quant's fp8 layout (one calibrated float32 scale per kv head) and
the Hadamard rotation: the bytes per token, a slow per-element spec of the write
(clamp, e4m3 round to nearest even), Triton == reference for the write and for decode
and prefill attention under the interpreter on irregular shapes, and the rotation
leaving attention unchanged."""

import pytest
import torch

import kernels
from kernels.paged_attention import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
)

DTYPE = "fp8"
# (num_heads, num_kv_heads, head_dim, block_size): GQA ratios 1, 4, 3
SHAPES = [(2, 2, 64, 16), (8, 2, 32, 8), (9, 3, 64, 16)]


def static_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=0, **kw):
    cache = kernels.allocate_kv_cache(
        DTYPE, num_blocks, block_size, num_kv_heads, head_dim, **kw
    )
    g = torch.Generator().manual_seed(seed)
    # per-head scales far apart, so a kernel reading another head's scale shows
    key_scale = 2.0 ** torch.randint(-6, 2, (num_kv_heads,), generator=g) / 448
    value_scale = 2.0 ** torch.randint(-6, 2, (num_kv_heads,), generator=g) / 448
    kernels.set_static_scales(cache, key_scale, value_scale)
    return cache


def random_kv(num_tokens, num_kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 0.5
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 0.5
    key[0, 0, 0] = 1e4  # saturates: stored as +-448 * scale, never inf/NaN
    return key, value


def test_it_takes_half_the_bf16_bytes_plus_its_scales():
    cache = static_cache(3, 16, 2, 64)
    per_token = kernels.kv_bytes_per_token(DTYPE, 2, 64)

    assert per_token * 2 == kernels.kv_bytes_per_token("bf16", 2, 64)
    static = kernels.kv_static_bytes(DTYPE, 2)
    assert static == 2 * 2 * 4
    assert cache.nbytes == per_token * 3 * 16 + static


def test_it_refuses_writes_before_its_scales_are_set():
    cache = kernels.allocate_kv_cache(DTYPE, 2, 16, 2, 64)
    key, value = random_kv(3, 2, 64)

    with pytest.raises(ValueError, match="set_static_scales"):
        kernels.write_kv(cache, key, value, torch.arange(3))
    with pytest.raises(ValueError, match="positive and finite"):
        kernels.set_static_scales(cache, torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"must be \[2\]"):
        kernels.set_static_scales(cache, torch.ones(3), torch.ones(2))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_it_stores_each_element_as_e4m3_of_its_heads_scale(impl):
    cache = static_cache(3, 16, 2, 64)
    key, value = random_kv(20, 2, 64)
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(1))[:20]

    kernels.write_kv(cache, key, value, slots, impl=impl)

    for src, store, scale in (
        (key, cache.key, cache.key_scale),
        (value, cache.value, cache.value_scale),
    ):
        flat = store.view(-1, 2, 64)[slots].float()  # [20, 2, 64]
        for head in range(2):
            y = (src[:, head] / scale[head]).clamp(-448, 448)
            want = y.to(torch.float8_e4m3fn).float()
            assert torch.equal(flat[:, head], want)
    assert cache.key.view(-1, 2, 64)[slots[0], 0, 0].float() == 448.0


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "bs"), SHAPES)
def test_it_decodes_and_prefills_with_triton_like_the_reference(
    num_heads, num_kv_heads, head_dim, bs
):
    context = [1, bs + 3, 3 * bs - 1]  # irregular lengths, blocks shuffled
    num_blocks = sum(-(-n // bs) for n in context) + 1
    cache = static_cache(num_blocks, bs, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))
    tables, start = [], 0
    width = max(-(-n // bs) for n in context)
    for n in context:
        blocks = perm[start : start + -(-n // bs)].tolist()
        start += len(blocks)
        tables.append(blocks + [0] * (width - len(blocks)))
        pos = torch.arange(n)
        slots = torch.tensor(blocks)[pos // bs] * bs + pos % bs
        key, value = random_kv(n, num_kv_heads, head_dim, seed=n)
        kernels.write_kv(cache, key, value, slots)
    tables = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(context, dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(len(context), num_heads, head_dim, generator=g)

    want = paged_decode_attention_reference(query, cache, tables, lens, 0.125)
    got = kernels.paged_decode_attention(
        query, cache, tables, lens, 0.125, impl="triton"
    )
    assert torch.allclose(got, want, atol=2e-5, rtol=2e-5)

    # prefill: the last 1, 2 and 3 positions of each sequence are new
    new = [1, 2, 3]
    qsl = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    queries = torch.randn(sum(new), num_heads, head_dim, generator=g)
    want = paged_prefill_attention_reference(queries, cache, tables, qsl, lens, 0.125)
    got = kernels.paged_prefill_attention(
        queries, cache, tables, qsl, lens, 0.125, impl="triton"
    )
    assert torch.allclose(got, want, atol=2e-5, rtol=2e-5)


def test_its_hadamard_rotation_leaves_attention_unchanged():
    r = kernels.hadamard(64).double()
    assert torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 7, 64, generator=g, dtype=torch.float64) for _ in "qkv")
    plain = torch.softmax(q @ k.transpose(1, 2), -1) @ v
    rotated = torch.softmax((q @ r) @ (k @ r).transpose(1, 2), -1) @ (v @ r) @ r.T
    assert torch.allclose(plain, rotated, atol=1e-12)
    with pytest.raises(ValueError, match="power of two"):
        kernels.hadamard(48)


def test_it_spreads_an_outlier_channel_so_int4_loses_less():
    # keys with a few outlier channels, as real models have (half the energy in 4)
    g = torch.Generator().manual_seed(5)
    key = torch.randn(256, 1, 64, generator=g)
    key[..., :4] *= 12
    r = kernels.hadamard(64)

    def error(x):
        q, s = kernels.quantize_kv(x, "int4")
        return (kernels.dequantize_kv(q, s, "int4") - x).norm() / x.norm()

    assert error(key @ r) < 0.6 * error(key)
