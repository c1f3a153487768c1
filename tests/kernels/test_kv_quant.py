"""kernels.kv_quant: cache layout and size, quantize-on-write (Triton == reference ==
a slow per-token loop), round-trip error bounds per dtype."""

import math

import numpy as np
import pytest
import torch

import kernels
from kernels import kv_quant
from kernels._triton import tl, triton
from tests.kernels.compile_helper import compile_for_sm90

# fp8 (one calibrated scale per head) has its own tests: test_kv_static.py; int4c
# (no write kernel, refused by name here) tests/gpuagent/engine/test_kv_int4c.py
PER_TOKEN_DTYPES = [
    d
    for d in kernels.KV_CACHE_DTYPES
    if d not in (*kernels.STATIC_SCALE_DTYPES, *kernels.CENTERED_DTYPES)
]

QMAX = {"fp8-per-token": 448.0, "int8": 127.0, "int4": 7.5}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def codes(cache, which: str) -> torch.Tensor:
    """Stored codes as int32, int4 nibbles unpacked; adjacent codes differ by 1."""
    stored = storage_bytes(getattr(cache, which))
    if cache.dtype == "int4":
        stored = torch.stack((stored & 0xF, stored >> 4), dim=-1)
    if stored.dtype in (torch.bfloat16, torch.float16):
        stored = stored.view(torch.int16)
    if stored.dtype == torch.float32:
        stored = stored.view(torch.int32)
    return stored.int()


def random_kv(num_tokens, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Per-vector magnitudes spread over 2^-8 .. 2^4 so scales cover a wide range.
    mag = 2.0 ** torch.randint(-8, 5, (num_tokens, num_kv_heads, 1), generator=g)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * mag
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * mag
    return key.to(dtype), value.to(dtype)


def shuffled_slots(num_tokens, num_slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[num_tokens // 2] = -1  # one padded token that must not be written
    return slots


def slow_quantize_head(x: np.ndarray, dtype: str) -> tuple[np.ndarray, float | None]:
    """One head vector, the spec in plain numpy: codes (unpacked) and fp16 scale."""
    if dtype in ("bf16", "fp16", "fp32"):
        target = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
        if target is None:  # fp32: a plain copy, the input bits themselves
            return x.astype(np.float32), None
        return torch.from_numpy(x).to(target).float().numpy(), None
    x = x.astype(np.float32)
    absmax = np.float32(max(abs(float(v)) for v in x))
    if dtype == "int4":
        return slow_int4_head(x, absmax)
    scale = np.float32(absmax / np.float32(QMAX[dtype]) * np.float32(1 + 2**-10))
    scale = float(np.float16(max(scale, np.float32(2**-14))))
    y = x / np.float32(scale)
    if dtype == "fp8-per-token":
        codes = [
            torch.tensor(float(v)).to(torch.float8_e4m3fn).float().item() for v in y
        ]
    elif dtype == "int8":
        codes = [min(127, max(-127, math.floor(float(v) + 0.5))) for v in y]
    else:
        codes = [min(15, max(0, math.floor(float(v) + 8.0))) for v in y]
    return np.array(codes, dtype=np.float32), scale


def slow_int4_head(x: np.ndarray, absmax: np.float32) -> tuple[np.ndarray, float]:
    """int4: of the scales absmax / 7.5 * f, f = 1, 0.95, .., 0.8 (rounded up to
    float16), the one whose levels (u - 7.5) * scale lie closest to x."""
    best = None
    for i in range(5):
        factor = np.float32(1.0 - 0.05 * i)
        scale = np.float32(absmax / np.float32(7.5) * factor * np.float32(1 + 2**-10))
        scale = np.float32(np.float16(max(scale, np.float32(2**-14))))
        codes = np.clip(np.floor(x / scale + np.float32(8.0)), 0, 15)
        err = float(np.sum((x - (codes - np.float32(7.5)) * scale) ** 2))
        if best is None or err < best[0]:
            best = (err, codes.astype(np.float32), float(scale))
    return best[1], best[2]


def slow_read_head(cache, slot: int, head: int, which: str):
    """Read one (slot, head) back from the cache: unpacked codes and the fp16 scale."""
    block, offset = divmod(slot, cache.block_size)
    store = getattr(cache, which)[block, offset, head]
    if cache.dtype == "int4":
        codes = []
        for byte in store.tolist():
            codes += [byte & 0xF, byte >> 4]
        codes = np.array(codes, dtype=np.float32)
    else:
        codes = store.float().numpy()
    scale_t = getattr(cache, f"{which}_scale")
    scale = None if scale_t is None else float(scale_t[block, offset, head])
    return codes, scale


@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_it_counts_every_allocated_byte_per_token(dtype, head_dim):
    cache = kernels.allocate_kv_cache(dtype, 3, 16, 2, head_dim)

    per_token = kernels.kv_bytes_per_token(dtype, 2, head_dim)

    assert per_token * 3 * 16 == cache.nbytes
    assert cache.nbytes == sum(
        t.untyped_storage().nbytes()
        for t in (cache.key, cache.value, cache.key_scale, cache.value_scale)
        if t is not None
    )


@pytest.mark.parametrize(
    ("dtype", "budget"), [("fp8-per-token", 0.52), ("int8", 0.52), ("int4", 0.27)]
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_it_meets_the_bytes_per_token_budget_against_bf16(dtype, budget, head_dim):
    ratio = kernels.kv_bytes_per_token(dtype, 8, head_dim) / kernels.kv_bytes_per_token(
        "bf16", 8, head_dim
    )

    assert ratio <= budget


def test_it_rejects_unknown_dtypes_and_bad_shapes():
    with pytest.raises(ValueError, match="KV cache dtype"):
        kernels.allocate_kv_cache("int2", 1, 16, 1, 64)
    cache = kernels.allocate_kv_cache("int8", 2, 16, 2, 64)
    with pytest.raises(ValueError, match="key must be"):
        kernels.write_kv(
            cache,
            torch.zeros(3, 2, 32),
            torch.zeros(3, 2, 32),
            torch.zeros(3, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="int64"):
        kernels.write_kv(
            cache,
            torch.zeros(3, 2, 64),
            torch.zeros(3, 2, 64),
            torch.zeros(3, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="impl"):
        kernels.write_kv(
            cache,
            torch.zeros(3, 2, 64),
            torch.zeros(3, 2, 64),
            torch.zeros(3, dtype=torch.int64),
            impl="cuda",
        )


def test_it_refuses_triton_on_cpu_tensors_outside_the_interpreter(monkeypatch):
    cache = kernels.allocate_kv_cache("int8", 2, 16, 2, 64)
    key = torch.zeros(3, 2, 64)
    monkeypatch.delenv("TRITON_INTERPRET")

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.write_kv(
            cache, key, key, torch.zeros(3, dtype=torch.int64), impl="triton"
        )


@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
def test_it_writes_through_the_slot_mapping_like_a_slow_loop(dtype):
    cache = kernels.allocate_kv_cache(dtype, 4, 16, 2, 64)
    key, value = random_kv(11, 2, 64, dtype=torch.bfloat16)
    slots = shuffled_slots(11, cache.num_slots)

    kernels.write_kv(cache, key, value, slots, impl="reference")

    for t, slot in enumerate(slots.tolist()):
        for head in range(2):
            for which, src in (("key", key), ("value", value)):
                if slot < 0:
                    continue
                want_codes, want_scale = slow_quantize_head(
                    src[t, head].float().numpy(), dtype
                )
                got_codes, got_scale = slow_read_head(cache, slot, head, which)
                np.testing.assert_array_equal(got_codes, want_codes)
                assert got_scale == want_scale
    # The skipped token's slot is untouched.
    written = set(slots.tolist()) - {-1}
    untouched = [s for s in range(cache.num_slots) if s not in written]
    flat = storage_bytes(cache.key).reshape(cache.num_slots, -1)
    assert not flat[untouched].any()


@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
@pytest.mark.parametrize(
    ("block_size", "head_dim", "input_dtype"),
    [(16, 64, torch.bfloat16), (32, 128, torch.float32)],
)
def test_it_writes_the_same_bytes_with_triton_as_the_reference(
    dtype, block_size, head_dim, input_dtype
):
    ref = kernels.allocate_kv_cache(dtype, 3, block_size, 2, head_dim)
    tri = kernels.allocate_kv_cache(dtype, 3, block_size, 2, head_dim)
    key, value = random_kv(9, 2, head_dim, dtype=input_dtype, seed=1)
    slots = shuffled_slots(9, ref.num_slots, seed=2)

    kernels.write_kv(ref, key, value, slots, impl="reference")
    kernels.write_kv(tri, key, value, slots, impl="triton")

    assert torch.equal(storage_bytes(tri.key), storage_bytes(ref.key))
    assert torch.equal(storage_bytes(tri.value), storage_bytes(ref.value))
    if ref.key_scale is not None:
        assert torch.equal(tri.key_scale, ref.key_scale)
        assert torch.equal(tri.value_scale, ref.value_scale)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_it_stores_float32_key_value_bit_exactly_in_an_fp32_cache(impl):
    cache = kernels.allocate_kv_cache("fp32", 3, 16, 2, 64)
    key, value = random_kv(9, 2, 64, seed=7)  # float32, magnitudes 2^-8 .. 2^4
    slots = shuffled_slots(9, cache.num_slots, seed=8)

    kernels.write_kv(cache, key, value, slots, impl=impl)

    keep = slots >= 0
    rows = slots[keep]
    assert torch.equal(cache.key.view(cache.num_slots, 2, 64)[rows], key[keep])
    assert torch.equal(cache.value.view(cache.num_slots, 2, 64)[rows], value[keep])
    assert cache.key_scale is None and cache.value_scale is None
    untouched = torch.ones(cache.num_slots, dtype=torch.bool)
    untouched[rows] = False
    assert not cache.key.view(cache.num_slots, -1)[untouched].any()


@triton.jit
def _encode_fp8_kernel(
    x_ptr,  # [N] float32 values with |x| <= 448
    out_ptr,  # [N] uint8 e4m3fn bits
    N: tl.constexpr,
):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, kv_quant._fp32_to_e4m3_bits(tl.load(x_ptr + offs)))


def test_it_rounds_fp8_ties_carries_and_subnormals_like_torch():
    # Every finite e4m3 value, the midpoints between neighbours (ties) and the floats
    # right next to those midpoints: the carry into the exponent and round-to-even.
    codes = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    x = torch.cat([values, mids, near, torch.tensor([-0.0, 2.0**-12, 447.9])])
    x = torch.cat([x, -x])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    out = torch.empty(n, dtype=torch.uint8)

    _encode_fp8_kernel[(1,)](x, out, N=n)

    assert torch.equal(out, x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8"])
def test_it_rounds_the_stored_scale_up_so_codes_never_clip(dtype):
    # absmax values whose absmax/QMAX sits just above a float16 value: a plain cast
    # would round the scale down and push |x / scale| past the code range.
    g = torch.Generator().manual_seed(3)
    base = torch.rand(256, generator=g) * 10 + 0.01
    fp16_grid = (base / QMAX[dtype]).half().float()
    absmax = torch.nextafter(fp16_grid, fp16_grid + 1) * QMAX[dtype]
    x = torch.randn(256, 64, generator=g).clamp(-0.9, 0.9) * absmax[:, None]
    x[:, 5] = absmax

    stored, scale = kernels.quantize_kv(x, dtype)

    assert (scale.float() * QMAX[dtype] >= absmax).all()
    err = (kernels.dequantize_kv(stored, scale, dtype) - x).abs()
    # No clipping: the absmax element is reproduced within half a step.
    assert (
        err[:, 5] <= scale.float() * (0.5 if dtype != "fp8-per-token" else 16)
    ).all()


@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
def test_it_round_trips_within_the_dtype_error_bound(dtype):
    key, _ = random_kv(64, 4, 128, seed=4)
    key[0, 0] = 0.0  # an all-zero vector must survive (finite scale)

    stored, scale = kernels.quantize_kv(key, dtype)
    back = kernels.dequantize_kv(stored, scale, dtype)

    err = (back - key).abs()
    if dtype in ("bf16", "fp16", "fp32"):
        assert torch.equal(back, key.to(stored.dtype).float())
        return
    s = scale.float()[..., None]
    if dtype == "fp8-per-token":
        # Half an ulp: 2^-4 relative for normals, half of the 2^-9 subnormal step.
        bound = torch.maximum(key.abs() * 2.0**-4, s * 2.0**-10)
    elif dtype == "int4":
        # a scale under absmax / 7.5 may clip the loudest elements (int4 picks the
        # scale with the least squared error): within half a step inside the levels
        bound = torch.where(key.abs() <= 7.5 * s, s / 2, key.abs() - 7 * s)
    else:
        bound = s / 2
    assert (err <= bound * (1 + 1e-6)).all()
    # All-zero vector: the scale floor 2^-14 keeps it finite and (almost) zero; int4
    # has no zero code (half-integer levels), so it reads back as +-2^-15.
    assert back[0, 0].abs().max() <= 2.0**-15


@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
def test_it_gathers_one_sequence_back_in_position_order(dtype):
    cache = kernels.allocate_kv_cache(dtype, 6, 16, 2, 64)
    key, value = random_kv(37, 2, 64, seed=5)
    block_table = torch.tensor([4, 0, 5], dtype=torch.int32)  # non-contiguous blocks
    pos = torch.arange(37)
    slots = block_table.long()[pos // 16] * 16 + pos % 16
    kernels.write_kv(cache, key, value, slots)

    k, v = kernels.gather_kv(cache, block_table, 37)

    for t in range(37):
        for src, got in ((key, k), (value, v)):
            want = kernels.dequantize_kv(*kernels.quantize_kv(src[t], dtype), dtype)
            assert torch.equal(got[t], want)


def ring_slots(num_tokens, window, num_windows, seed=0):
    """window_slots [T]: distinct ring slots for some tokens, -1 for the others."""
    g = torch.Generator().manual_seed(seed)
    ring = torch.randperm(num_windows * window, generator=g)[:num_tokens]
    ring[::3] = -1  # every third token stays out of the window
    return ring


@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8", "int4"])
def test_it_counts_the_window_bytes(dtype):
    cache = kernels.allocate_kv_cache(dtype, 3, 16, 2, 64, window=8, num_windows=5)

    per_token = kernels.kv_bytes_per_token(dtype, 2, 64)
    per_window = kernels.kv_window_bytes(2, 64, 8)

    assert cache.nbytes == per_token * 3 * 16 + per_window * 5
    assert cache.window_key.shape == (5, 8, 2, 64)
    assert cache.window_key.dtype == torch.bfloat16
    assert cache.num_windows == 5


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_it_refuses_a_window_on_an_unquantized_cache(dtype):
    with pytest.raises(ValueError, match="quantized caches"):
        kernels.allocate_kv_cache(dtype, 3, 16, 2, 64, window=8, num_windows=2)


def test_it_refuses_a_window_without_rows_and_rows_without_a_window():
    with pytest.raises(ValueError, match="both be 0"):
        kernels.allocate_kv_cache("int8", 3, 16, 2, 64, window=8)
    with pytest.raises(ValueError, match="both be 0"):
        kernels.allocate_kv_cache("int8", 3, 16, 2, 64, num_windows=2)
    with pytest.raises(ValueError, match=">= 0"):
        kernels.allocate_kv_cache("int8", 3, 16, 2, 64, window=-8, num_windows=2)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_it_rejects_missing_or_unexpected_window_slots(impl):
    windowed = kernels.allocate_kv_cache("int4", 2, 16, 2, 64, window=8, num_windows=2)
    plain = kernels.allocate_kv_cache("int4", 2, 16, 2, 64)
    key = torch.zeros(3, 2, 64)
    slots = torch.zeros(3, dtype=torch.int64)
    ring = torch.tensor([0, 1, -1])

    with pytest.raises(ValueError, match="needs window_slots"):
        kernels.write_kv(windowed, key, key, slots, impl=impl)
    with pytest.raises(ValueError, match="needs window_slots"):
        kernels.write_kv(windowed, key, key, slots, ring.int(), impl=impl)
    with pytest.raises(ValueError, match="needs window_slots"):
        kernels.write_kv(windowed, key, key, slots, ring[:2], impl=impl)
    with pytest.raises(ValueError, match="has no window"):
        kernels.write_kv(plain, key, key, slots, ring, impl=impl)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
def test_it_writes_the_window_in_bf16_like_a_slow_loop(impl, input_dtype):
    cache = kernels.allocate_kv_cache("int4", 3, 16, 2, 64, window=8, num_windows=3)
    key, value = random_kv(10, 2, 64, dtype=input_dtype, seed=9)
    slots = shuffled_slots(10, cache.num_slots, seed=10)
    ring = ring_slots(10, 8, 3, seed=11)

    kernels.write_kv(cache, key, value, slots, ring, impl=impl)

    for which, src in (("window_key", key), ("window_value", value)):
        store = getattr(cache, which)
        written = set()
        for t, r in enumerate(ring.tolist()):
            if r < 0:
                continue
            row, offset = divmod(r, 8)
            # torch's cast rounds to nearest even, as the GPU does.
            assert torch.equal(store[row, offset], src[t].to(torch.bfloat16))
            written.add(r)
        untouched = [r for r in range(3 * 8) if r not in written]
        assert not store.view(3 * 8, -1)[untouched].any()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_it_leaves_the_window_untouched_when_no_token_enters_it(impl):
    cache = kernels.allocate_kv_cache("int8", 3, 16, 2, 64, window=8, num_windows=2)
    before = torch.randn(
        cache.window_key.shape, generator=torch.Generator().manual_seed(18)
    )
    cache.window_key.copy_(before)
    cache.window_value.copy_(-before)
    key, value = random_kv(6, 2, 64, seed=12)
    slots = shuffled_slots(6, cache.num_slots, seed=13)

    kernels.write_kv(cache, key, value, slots, torch.full((6,), -1), impl=impl)

    assert torch.equal(cache.window_key, before.to(torch.bfloat16))
    assert torch.equal(cache.window_value, (-before).to(torch.bfloat16))
    assert storage_bytes(cache.key).any()  # the blocks were written all the same


@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8", "int4"])
def test_it_writes_the_same_window_with_triton_as_the_reference(dtype):
    ref = kernels.allocate_kv_cache(dtype, 3, 16, 2, 64, window=8, num_windows=3)
    tri = kernels.allocate_kv_cache(dtype, 3, 16, 2, 64, window=8, num_windows=3)
    key, value = random_kv(9, 2, 64, dtype=torch.float16, seed=14)
    slots = shuffled_slots(9, ref.num_slots, seed=15)
    ring = ring_slots(9, 8, 3, seed=16)
    ring[4] = 5  # a token skipped by the blocks (slot -1) still enters the window

    kernels.write_kv(ref, key, value, slots, ring, impl="reference")
    kernels.write_kv(tri, key, value, slots, ring, impl="triton")

    assert torch.equal(tri.window_key, ref.window_key)
    assert torch.equal(tri.window_value, ref.window_value)
    assert tri.window_key.view(-1, 2, 64)[5].any()
    assert torch.equal(storage_bytes(tri.key), storage_bytes(ref.key))
    assert torch.equal(tri.value_scale, ref.value_scale)


@pytest.mark.parametrize("dtype", ["fp8-per-token", "int4"])
def test_it_gathers_the_newest_positions_from_the_window(dtype):
    cache = kernels.allocate_kv_cache(dtype, 6, 16, 2, 64, window=8, num_windows=3)
    key, value = random_kv(21, 2, 64, seed=17)
    block_table = torch.tensor([5, 2], dtype=torch.int32)
    pos = torch.arange(21)
    slots = block_table.long()[pos // 16] * 16 + pos % 16
    ring = torch.where(pos >= 21 - 8, 2 * 8 + pos % 8, -1)  # window row 2
    kernels.write_kv(cache, key, value, slots, ring)

    k, v = kernels.gather_kv(cache, block_table, 21, window_row=2)

    for t in range(21):
        for src, got in ((key, k), (value, v)):
            if t >= 21 - 8:
                want = src[t].to(torch.bfloat16).float()
            else:
                want = kernels.dequantize_kv(*kernels.quantize_kv(src[t], dtype), dtype)
            assert torch.equal(got[t], want), t


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", PER_TOKEN_DTYPES)
def test_it_writes_like_the_reference_on_cuda(dtype):
    ref = kernels.allocate_kv_cache(dtype, 512, 16, 8, 128, device="cuda")
    tri = kernels.allocate_kv_cache(dtype, 512, 16, 8, 128, device="cuda")
    key, value = random_kv(4000, 8, 128, dtype=torch.bfloat16, seed=6)
    key, value = key.cuda(), value.cuda()
    slots = shuffled_slots(4000, ref.num_slots).cuda()

    kernels.write_kv(ref, key, value, slots, impl="reference")
    kernels.write_kv(tri, key, value, slots, impl="triton")

    # GPU division may differ in the last bit: codes at most one step apart.
    for which in ("key", "value"):
        got, want = codes(tri, which), codes(ref, which)
        assert (got - want).abs().max() <= 1, which
        assert (got != want).float().mean() < 1e-3, which
    if ref.key_scale is not None:
        assert torch.equal(tri.key_scale, ref.key_scale)
        assert torch.equal(tri.value_scale, ref.value_scale)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["fp8-per-token", "int8", "int4"])
def test_it_writes_the_window_like_the_reference_on_cuda(dtype):
    caches = [
        kernels.allocate_kv_cache(
            dtype, 128, 16, 8, 128, device="cuda", window=64, num_windows=40
        )
        for _ in range(2)
    ]
    key, value = random_kv(2000, 8, 128, dtype=torch.bfloat16, seed=19)
    key, value = key.cuda(), value.cuda()
    slots = shuffled_slots(2000, caches[0].num_slots).cuda()
    ring = ring_slots(2000, 64, 40, seed=20).cuda()

    for cache, impl in zip(caches, ("reference", "triton"), strict=True):
        kernels.write_kv(cache, key, value, slots, ring, impl=impl)

    ref, tri = caches
    assert torch.equal(tri.window_key, ref.window_key)
    assert torch.equal(tri.window_value, ref.window_value)


def test_it_compiles_the_kernels_for_sm90_without_a_gpu():
    result = compile_for_sm90("kv_quant")

    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_int4_keeps_the_scale_with_the_least_squared_error():
    key, _ = random_kv(256, 2, 64, seed=9)
    x = key.float()

    stored, scale = kernels.quantize_kv(x, "int4")

    chosen = ((kernels.dequantize_kv(stored, scale, "int4") - x) ** 2).sum(-1)
    absmax = x.abs().amax(-1)
    for factor in kv_quant.INT4_SCALE_FACTORS:
        plain = (absmax / 7.5 * factor * (1 + 2**-10)).clamp_min(2**-14).half()
        codes = torch.floor(x / plain.float()[..., None] + 8).clamp(0, 15)
        err = ((x - (codes - 7.5) * plain.float()[..., None]) ** 2).sum(-1)
        assert (chosen <= err * (1 + 1e-6)).all()
    # on Gaussian head vectors a clipped scale wins for most (the absmax level is
    # wasted on one element): the squared error falls by more than a tenth
    plain = absmax / 7.5 * (1 + 2**-10)
    codes = torch.floor(x / plain.half().float()[..., None] + 8).clamp(0, 15)
    at_absmax = ((x - (codes - 7.5) * plain.half().float()[..., None]) ** 2).sum()
    assert chosen.sum() < 0.9 * at_absmax
