"""kernels.weight_matmul: int4 packing bit for bit vs compressed-tensors, quantizer
error bounds, reference == a slow loop, Triton == reference at batch 1..256, torch's
CPU kernels == the reference on bf16-rounded inputs."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)

import kernels
from kernels import weight_matmul
from tests.kernels.compile_helper import compile_for_sm90

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (atol, rtol) of Triton vs reference per (weight format, activation dtype).
TOLERANCE = {
    ("int8", torch.float32): (1e-4, 1e-5),
    ("int4", torch.float32): (1e-4, 1e-5),
    ("int8", torch.bfloat16): (2e-2, 2e-2),  # one bf16 output rounding
    ("int4", torch.bfloat16): (2e-2, 2e-2),
}
# The decode tile with one K split: the kernel stores the output itself.
NO_SPLIT = weight_matmul.TileConfig(16, 64, 128, 4, split_k=1)


def weights(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # Rows and groups of very different magnitude, so scales really differ.
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    w[:, : k // 4] *= 8
    return w.to(dtype)


def test_it_packs_int4_bit_for_bit_like_compressed_tensors():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (24, 512), generator=g, dtype=torch.int8)

    packed = kernels.pack_int4(q)

    assert packed.dtype == torch.int32 and packed.shape == (24, 64)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_from_int32(packed, 4, q.shape), q)
    assert torch.equal(kernels.unpack_int4(pack_to_int32(q, 4)), q)


def test_it_quantizes_int4_into_the_pack_quantized_layout():
    w = weights(16, 384)

    packed, scale = kernels.quantize_weight_int4(w, group_size=128)

    assert packed.shape == (16, 48) and packed.dtype == torch.int32
    assert scale.shape == (16, 3) and scale.dtype == w.dtype
    q = unpack_from_int32(packed, 4, torch.Size([16, 384])).float()
    back = q * scale.repeat_interleave(128, dim=1)
    # Round to nearest, absmax / 7.5: every element within half a step.
    step = scale.repeat_interleave(128, dim=1)
    assert ((back - w).abs() <= step / 2 * (1 + 1e-4)).all()
    assert torch.equal(kernels.dequantize_weight_int4(packed, scale), back)


def test_it_quantizes_int8_per_output_channel_within_half_a_step():
    w = weights(32, 200)

    q, scale = kernels.quantize_weight_int8(w)

    assert q.dtype == torch.int8 and scale.shape == (32,)
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()


def slow_int4_codes(packed):
    """[N, K] codes word by word with integer arithmetic (float64: exact)."""
    rows = []
    for words in packed.tolist():
        rows.append(
            [((w & 0xFFFFFFFF) >> (4 * s) & 0xF) - 8 for w in words for s in range(8)]
        )
    return torch.tensor(rows, dtype=torch.float64)


def slow_int4_matmul(x, packed, scale, group_size):
    """Codes from the word-by-word loop times their group's scale, dot in float64."""
    w = slow_int4_codes(packed) * scale.double().repeat_interleave(group_size, dim=1)
    return x.double() @ w.t()


def test_it_matches_a_slow_unpacking_loop_in_the_int4_reference():
    w = weights(8, 256, seed=2)
    packed, scale = kernels.quantize_weight_int4(w)
    x = torch.randn(3, 256)

    out = kernels.weight_int4_matmul(x, packed, scale, impl="reference")

    want = slow_int4_matmul(x, packed, scale, 128)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-5)


def test_it_matches_a_slow_loop_in_the_int8_reference():
    w = weights(8, 72, seed=3)
    q, scale = kernels.quantize_weight_int8(w)
    x = torch.randn(5, 72)

    out = kernels.weight_int8_matmul(x, q, scale, impl="reference")

    for m in range(5):
        for n in range(8):
            want = sum(
                float(x[m, k]) * int(q[n, k]) * float(scale[n]) for k in range(72)
            )
            assert abs(float(out[m, n]) - want) <= 1e-4 + 1e-5 * abs(want)


@pytest.mark.parametrize("batch", [1, 3, 16, 17, 130])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_it_runs_int4_triton_like_the_reference(batch, x_dtype):
    # N not a multiple of the tile; K = 3 groups (split-K over them at small batch).
    w = weights(72, 384, seed=4)
    packed, scale = kernels.quantize_weight_int4(w)
    x = torch.randn(batch, 384).to(x_dtype)

    got = kernels.weight_int4_matmul(x, packed, scale, impl="triton")

    want = kernels.weight_int4_matmul(x, packed, scale, impl="reference")
    atol, rtol = TOLERANCE[("int4", x_dtype)]
    assert got.dtype == x_dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("batch", [1, 5, 16, 64, 256])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_it_runs_int8_triton_like_the_reference(batch, x_dtype):
    # K = 200: not a multiple of the K tile, so the K mask matters.
    w = weights(40, 200, seed=5)
    q, scale = kernels.quantize_weight_int8(w)
    x = torch.randn(batch, 200).to(x_dtype)

    got = kernels.weight_int8_matmul(x, q, scale, impl="triton")

    want = kernels.weight_int8_matmul(x, q, scale, impl="reference")
    atol, rtol = TOLERANCE[("int8", x_dtype)]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_it_splits_k_for_small_batches():
    # A layer with one output tile gets several K splits; they must add up.
    assert weight_matmul._split_k(grid_mn=1, k_tiles=32) == 8
    w = weights(16, 1024, seed=6)
    packed, scale = kernels.quantize_weight_int4(w)
    x = torch.randn(2, 1024)

    got = kernels.weight_int4_matmul(x, packed, scale, impl="triton")

    want = kernels.weight_int4_matmul(x, packed, scale, impl="reference")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_it_writes_the_output_directly_without_a_split(fmt):
    w = weights(24, 256, seed=8)
    x = torch.randn(4, 256).bfloat16()
    if fmt == "int8":
        q, scale = kernels.quantize_weight_int8(w)
        got = weight_matmul._weight_int8_matmul_triton(x, q, scale, NO_SPLIT)
        want = kernels.weight_int8_matmul(x, q, scale, impl="reference")
    else:
        packed, scale = kernels.quantize_weight_int4(w)
        got = weight_matmul._weight_int4_matmul_triton(x, packed, scale, 128, NO_SPLIT)
        want = kernels.weight_int4_matmul(x, packed, scale, impl="reference")

    assert got.dtype == torch.bfloat16
    atol, rtol = TOLERANCE[(fmt, torch.bfloat16)]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_it_rejects_bad_shapes():
    packed, scale = kernels.quantize_weight_int4(weights(16, 256))
    with pytest.raises(ValueError, match="x must be"):
        kernels.weight_int4_matmul(torch.randn(2, 128), packed, scale)
    with pytest.raises(ValueError, match="weight_scale"):
        kernels.weight_int4_matmul(torch.randn(2, 256), packed, scale[:, :1])
    with pytest.raises(ValueError, match="multiple of group_size"):
        kernels.quantize_weight_int4(weights(4, 100))
    q, s = kernels.quantize_weight_int8(weights(16, 64))
    with pytest.raises(ValueError, match="scale"):
        kernels.weight_int8_matmul(torch.randn(2, 64), q, s[:8])


def zero_scale_for(scale, seed):
    """zp * scale [N, G] with zero points in [-8, 7] (an asymmetric int4 weight)."""
    g = torch.Generator().manual_seed(seed)
    zp = torch.randint(-8, 8, scale.shape, generator=g)
    return zp * scale


def test_it_subtracts_the_zero_point_in_the_int4_reference():
    w = weights(8, 256, seed=9)
    packed, scale = kernels.quantize_weight_int4(w, group_size=64)
    zero_scale = zero_scale_for(scale, seed=9)
    x = torch.randn(3, 256)

    out = kernels.weight_int4_matmul(
        x, packed, scale, 64, impl="reference", weight_zero_scale=zero_scale
    )

    # W = (q - zp) s: the symmetric loop minus zp * s over each group's inputs
    sums = x.double().view(3, 4, 64).sum(-1)  # [M, G]
    want = slow_int4_matmul(x, packed, scale, 64) - sums @ zero_scale.double().t()
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("contiguous", [True, False])
def test_it_dequantizes_int4_like_the_codes_times_their_group_scale(contiguous):
    w = weights(24, 192, seed=11)
    packed, scale = kernels.quantize_weight_int4(w, group_size=64)
    zero_scale = zero_scale_for(scale, seed=11)
    if not contiguous:  # the same words, laid out column-major
        packed = packed.t().contiguous().t()
    assert packed.is_contiguous() == contiguous

    got = kernels.dequantize_weight_int4(packed, scale, 64, zero_scale)

    # float32 as the reference computes it: code * scale, then minus zp * scale
    expand = torch.repeat_interleave
    want = slow_int4_codes(packed).float() * expand(scale, 64, dim=1)
    want = want - expand(zero_scale, 64, dim=1)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("batch", [1, 5, 17])
def test_it_runs_asymmetric_int4_triton_like_the_reference(batch):
    w = weights(48, 384, seed=10)
    packed, scale = kernels.quantize_weight_int4(w, group_size=128)
    zero_scale = zero_scale_for(scale, seed=10)
    x = torch.randn(batch, 384)

    got = kernels.weight_int4_matmul(
        x, packed, scale, impl="triton", weight_zero_scale=zero_scale
    )

    want = kernels.weight_int4_matmul(
        x, packed, scale, impl="reference", weight_zero_scale=zero_scale
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def bf16(t):
    return t.bfloat16().float()


def assert_bf16_close(got, want):
    # The CPU kernels accumulate in float32 and round the output to bf16 (half a
    # unit in the 8th bit); the rest is float32 summation order.
    atol = 1e-5 * float(want.abs().amax()) if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=2**-8)


@pytest.mark.parametrize(
    ("batch", "n", "k"),
    [(1, 72, 208), (3, 5, 576), (17, 576, 1536), (6, 1, 16), (0, 32, 64)],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_it_runs_int8_on_torchs_cpu_kernel_like_the_reference(batch, n, k, x_dtype):
    q, scale = kernels.quantize_weight_int8(weights(n, k, seed=11))
    x = torch.randn(batch, k).to(x_dtype)
    packed = kernels.prepack_int8_cpu(q, scale)

    got = kernels.weight_int8_matmul(x, q, scale, cpu_weight=packed)

    # the same op on the inputs rounded as the kernel takes them
    want = kernels.weight_int8_matmul(bf16(x), q, bf16(scale), impl="reference")
    assert got.dtype == x_dtype and got.shape == (batch, n)
    assert_bf16_close(got, want)


@pytest.mark.parametrize(
    ("batch", "n", "k", "group_size", "asymmetric"),
    [
        (1, 16, 256, 32, False),
        (3, 48, 576, 64, True),
        (5, 80, 384, 128, False),
        (17, 592, 768, 256, True),
        (2, 64, 1536, 128, True),
        (7, 576, 576, 64, False),
    ],
)
def test_it_runs_int4_on_torchs_cpu_kernel_like_the_reference(
    batch, n, k, group_size, asymmetric
):
    packed, scale = kernels.quantize_weight_int4(weights(n, k, seed=12), group_size)
    zero_scale = zero_scale_for(scale, seed=12) if asymmetric else None
    x = torch.randn(batch, k)
    cpu_weight = kernels.prepack_int4_cpu(packed, scale, group_size, zero_scale)

    got = kernels.weight_int4_matmul(
        x,
        packed,
        scale,
        group_size,
        weight_zero_scale=zero_scale,
        cpu_weight=cpu_weight,
    )

    want = kernels.weight_int4_matmul(
        bf16(x),
        packed,
        bf16(scale),
        group_size,
        impl="reference",
        weight_zero_scale=None if zero_scale is None else bf16(zero_scale),
    )
    assert got.dtype == torch.float32 and got.shape == (batch, n)
    assert_bf16_close(got, want)


@pytest.mark.parametrize("fmt", ["int8", "int4-asym"])
def test_it_stays_within_bf16_rounding_of_the_float32_reference(fmt):
    # Elementwise bound: x and the scales rounded to bf16 (2^-9 each, relative)
    # move each product by at most 2^-8 |x| |W|; the output rounding adds 2^-9 |y|.
    n, k = 64, 512
    w = weights(n, k, seed=13)
    x = torch.randn(9, k)
    if fmt == "int8":
        q, scale = kernels.quantize_weight_int8(w)
        got = kernels.weight_int8_matmul(
            x, q, scale, cpu_weight=kernels.prepack_int8_cpu(q, scale)
        )
        want = kernels.weight_int8_matmul(x, q, scale, impl="reference")
        w_abs = (q.float() * scale[:, None]).abs()
    else:
        packed, scale = kernels.quantize_weight_int4(w, 64)
        zs = zero_scale_for(scale, seed=13)
        cpu_weight = kernels.prepack_int4_cpu(packed, scale, 64, zs)
        got = kernels.weight_int4_matmul(
            x, packed, scale, 64, weight_zero_scale=zs, cpu_weight=cpu_weight
        )
        want = kernels.weight_int4_matmul(
            x, packed, scale, 64, impl="reference", weight_zero_scale=zs
        )
        w_abs = kernels.dequantize_weight_int4(
            packed, scale, 64
        ).abs() + zs.abs().repeat_interleave(64, dim=1)

    bound = 2**-8 * (x.abs() @ w_abs.t()) + 2**-8 * want.abs()
    assert ((got - want).abs() <= bound).all()
    # and the bound is not vacuous: the outputs are far from 0 on that scale
    assert (bound < 0.05 * want.abs().max()).all()


def test_it_prepacks_for_the_cpu_only_where_torchs_kernels_apply():
    packed, scale = kernels.quantize_weight_int4(weights(72, 256))  # N % 16 != 0
    assert kernels.prepack_int4_cpu(packed, scale, 128) is None
    for group_size in (16, 512):  # the int4 kernel takes 32, 64, 128, 256
        packed, scale = kernels.quantize_weight_int4(weights(32, 1024), group_size)
        assert kernels.prepack_int4_cpu(packed, scale, group_size) is None
    q, s = kernels.quantize_weight_int8(weights(16, 200))  # K % 16 != 0
    assert kernels.prepack_int8_cpu(q, s) is None

    packed, scale = kernels.quantize_weight_int4(weights(32, 1024), 256)
    assert kernels.prepack_int4_cpu(packed, scale, 256) is not None
    q, s = kernels.quantize_weight_int8(weights(5, 208))
    assert kernels.prepack_int8_cpu(q, s) is not None


def test_it_runs_the_reference_when_asked_even_with_a_cpu_weight():
    q, scale = kernels.quantize_weight_int8(weights(32, 128, seed=14))
    x = torch.randn(3, 128)

    got = kernels.weight_int8_matmul(
        x, q, scale, impl="reference", cpu_weight=kernels.prepack_int8_cpu(q, scale)
    )

    assert torch.equal(got, weight_matmul.weight_int8_matmul_reference(x, q, scale))


def test_it_copies_a_misaligned_x_for_the_int8_kernel():
    # a bf16 view 16 bytes into its storage: the kernel's aligned loads need 32
    q, scale = kernels.quantize_weight_int8(weights(32, 208, seed=15))
    x = torch.randn(3 * 208 + 8).bfloat16()[8:].view(3, 208)
    assert x.data_ptr() % 32

    got = kernels.weight_int8_matmul(
        x, q, scale, cpu_weight=kernels.prepack_int8_cpu(q, scale)
    )

    want = kernels.weight_int8_matmul(x.float(), q, bf16(scale), impl="reference")
    assert_bf16_close(got, want)


def test_it_rejects_a_cpu_weight_of_another_shape_or_layout():
    packed, scale = kernels.quantize_weight_int4(weights(32, 256), 64)
    other = kernels.prepack_int4_cpu(packed[:16], scale[:16], 64)
    asym = kernels.prepack_int4_cpu(packed, scale, 64, zero_scale_for(scale, 0))
    x = torch.randn(2, 256)

    with pytest.raises(ValueError, match="cpu_weight"):
        kernels.weight_int4_matmul(x, packed, scale, 64, cpu_weight=other)
    with pytest.raises(ValueError, match="zero point"):
        kernels.weight_int4_matmul(x, packed, scale, 64, cpu_weight=asym)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 16, 256])
def test_it_runs_both_formats_like_the_reference_on_cuda(batch):
    w = weights(4096, 2048, seed=7, dtype=torch.bfloat16).cuda()
    x = torch.randn(batch, 2048, device="cuda", dtype=torch.bfloat16)
    packed, scale = kernels.quantize_weight_int4(w)
    q, s8 = kernels.quantize_weight_int8(w)

    got4 = kernels.weight_int4_matmul(x, packed, scale)
    got8 = kernels.weight_int8_matmul(x, q, s8)

    want4 = kernels.weight_int4_matmul(x, packed, scale, impl="reference")
    want8 = kernels.weight_int8_matmul(x, q, s8, impl="reference")
    torch.testing.assert_close(got4.float(), want4.float(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got8.float(), want8.float(), atol=5e-2, rtol=2e-2)


def test_it_compiles_the_kernels_for_sm90_without_a_gpu():
    result = compile_for_sm90("weight_matmul")

    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
