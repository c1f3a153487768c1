"""The fused int4 CPU kernel (kernels.int4_cpu) against exact arithmetic and the
torch reference, its dispatch from weight_int4_matmul, and its refusals."""

import platform

import pytest
import torch

from kernels import _int4_cpu, int4_cpu
from kernels.weight_matmul import (
    dequantize_weight_int4,
    quantize_weight_int4,
    weight_int4_matmul,
)


def layer(n, k, group, seed, zero_point=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    packed, scale = quantize_weight_int4(w, group)
    zero_scale = None
    if zero_point:
        zero_scale = torch.randn(n, k // group, generator=g) * scale
    return packed, scale.float(), zero_scale


def exact(x, packed, scale, group, zero_scale):
    w = dequantize_weight_int4(packed, scale, group, zero_scale).double()
    return x.double() @ w.t()


def run(x, packed, scale, group, zero_scale=None, threads=1, path=None):
    """The extension called directly, N taken from the scales."""
    (m, k), n = x.shape, scale.shape[0]
    y = torch.empty(m, n)
    zs = None if zero_scale is None else zero_scale.numpy()
    args = (x.numpy(), packed.numpy(), scale.numpy(), zs, y.numpy())
    _int4_cpu.int4_matmul(*args, m, n, k, group, threads, path)
    return y


def test_it_is_built_here_with_a_simd_build_for_this_x86_cpu():
    assert int4_cpu.AVAILABLE
    assert int4_cpu.PATHS[-1] == "portable"
    if platform.machine() == "x86_64":  # every x86-64 CPU here has AVX2
        assert "avx2" in int4_cpu.PATHS


GROUPS = [16, 32, 64, 128, 256]
# The AVX-512 build takes 16 codes per step (a group that is a multiple of 32).
PATH_GROUPS = [
    (path, group)
    for path in int4_cpu.PATHS
    for group in GROUPS
    if path != "avx512" or group % 32 == 0
]


@pytest.mark.parametrize(("path", "group"), PATH_GROUPS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, int4_cpu.MAX_ROWS, 16])
@pytest.mark.parametrize("zero_point", [False, True])
def test_each_build_matches_exact_arithmetic_within_float32_rounding(
    path, group, rows, zero_point
):
    n, k = 37, 4 * group  # an odd number of rows
    packed, scale, zero_scale = layer(
        n, k, group, seed=group + rows, zero_point=zero_point
    )
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))

    got = run(x, packed, scale, group, zero_scale, path=path)
    want = exact(x, packed, scale, group, zero_scale)
    reference = weight_int4_matmul(
        x, packed, scale, group, impl="reference", weight_zero_scale=zero_scale
    )

    w = dequantize_weight_int4(packed, scale, group, zero_scale).double()
    bound = 1e-5 * (x.double().abs() @ w.abs().t())  # float32 sums' rounding
    assert ((got.double() - want).abs() <= bound).all()
    assert ((reference.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("group", GROUPS)
def test_the_default_is_the_best_build_that_takes_the_group(group):
    packed, scale, zero_scale = layer(29, 2 * group, group, seed=8, zero_point=True)
    x = torch.randn(2, 2 * group, generator=torch.Generator().manual_seed(9))
    best = next(p for p, g in PATH_GROUPS if g == group)

    got = int4_cpu.int4_matmul(x, packed, scale, group, zero_scale)

    assert torch.equal(got, run(x, packed, scale, group, zero_scale, path=best))


def test_each_row_of_w_is_summed_the_same_on_any_number_of_threads():
    packed, scale, zero_scale = layer(101, 256, 64, seed=3, zero_point=True)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))

    one = run(x, packed, scale, 64, zero_scale, threads=1)
    for threads in (2, 3, 7, 64):
        assert torch.equal(run(x, packed, scale, 64, zero_scale, threads), one)


def test_weight_int4_matmul_runs_it_for_a_few_float32_rows_only(monkeypatch):
    calls = []
    real = int4_cpu.int4_matmul

    def spy(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(int4_cpu, "int4_matmul", spy)
    packed, scale, _ = layer(48, 256, 128, seed=5)
    for rows in (1, int4_cpu.MAX_ROWS, int4_cpu.MAX_ROWS + 1):
        x = torch.randn(rows, 256)
        y = weight_int4_matmul(x, packed, scale, 128)
        want = exact(x, packed, scale, 128, None)
        assert torch.allclose(y.double(), want, rtol=1e-4, atol=1e-4)
    weight_int4_matmul(torch.randn(1, 256).bfloat16(), packed, scale.bfloat16(), 128)
    weight_int4_matmul(torch.randn(1, 256), packed, scale, 128, impl="reference")

    assert calls == [1, int4_cpu.MAX_ROWS]


def test_a_buffer_of_the_wrong_size_is_refused_by_name():
    packed, scale, _ = layer(16, 128, 64, seed=6)
    x = torch.randn(1, 128)
    with pytest.raises(ValueError, match="scale holds"):
        run(x, packed, scale[:, :1].contiguous(), 64)
    with pytest.raises(ValueError, match="packed holds"):
        run(x, packed[:8].contiguous(), scale, 64)
    with pytest.raises(ValueError, match="group=24"):
        run(x, packed, scale, 24)
    with pytest.raises(ValueError, match="m=17"):
        run(torch.randn(17, 128), packed, scale, 64)
    with pytest.raises(ValueError, match="no path named sse9"):
        run(x, packed, scale, 64, path="sse9")


def test_a_build_that_cannot_take_the_group_is_refused_by_name():
    packed, scale, _ = layer(16, 128, 16, seed=7)
    x = torch.randn(1, 128)
    if "avx512" in int4_cpu.PATHS:
        with pytest.raises(ValueError, match="avx512 needs a group that is a multiple"):
            run(x, packed, scale, 16, path="avx512")
    for path in {"avx512", "avx2"} - set(int4_cpu.PATHS):
        with pytest.raises(ValueError, match=f"{path} does not run on this CPU"):
            run(x, packed, scale, 16, path=path)
