"""kernels.weight_matmul: int4 packing bit for bit vs compressed-tensors, quantizer
error bounds, reference == a slow loop, Triton == reference at batch 1..256."""

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


def slow_int4_matmul(x, packed, scale, group_size):
    """Row by row, word by word: unpack with integer arithmetic, dot in float64."""
    n, words = packed.shape
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for row in range(n):
        w_row = []
        for j, word in enumerate(packed[row].tolist()):
            word &= 0xFFFFFFFF
            for s in range(8):
                k = 8 * j + s
                code = ((word >> (4 * s)) & 0xF) - 8
                w_row.append(code * float(scale[row, k // group_size]))
        out[:, row] = x.double() @ torch.tensor(w_row, dtype=torch.float64)
    return out


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
        got = weight_matmul._weight_int8_matmul_triton(x, q, scale, split_k=1)
        want = kernels.weight_int8_matmul(x, q, scale, impl="reference")
    else:
        packed, scale = kernels.quantize_weight_int4(w)
        got = weight_matmul._weight_int4_matmul_triton(x, packed, scale, 128, split_k=1)
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
