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


# ---------------------------------------------------------------- int8 activations


def run_q8(x, packed, scale, group, zero_scale=None, threads=1, path=None):
    """The int8-activation kernel called directly, N taken from the scales."""
    (m, k), n = x.shape, scale.shape[0]
    y = torch.empty(m, n)
    zs = None if zero_scale is None else zero_scale.numpy()
    args = (x.numpy(), packed.numpy(), scale.numpy(), zs, y.numpy())
    _int4_cpu.int4_matmul_q8(*args, m, n, k, group, threads, path)
    return y


# The q8 builds' group widths: AVX-512 VNNI steps 128 columns (each half within a
# group: a multiple of 64), AVX-VNNI and AVX2 64, portable one block (32).
Q8_MIN_GROUP = {"avx512vnni": 64, "avxvnni": 64, "avx2": 64, "portable": 32}
Q8_PATH_GROUPS = [
    (path, group)
    for path in int4_cpu.Q8_PATHS
    for group in (32, 64, 128, 192, 256)
    if group % Q8_MIN_GROUP[path] == 0
]


def test_the_int8_activation_builds_include_vnni_on_this_cpu():
    assert int4_cpu.Q8_PATHS[-1] == "portable"
    flags = open("/proc/cpuinfo").read().split() if platform.system() == "Linux" else []
    if "avx512_vnni" in flags:
        assert int4_cpu.Q8_PATHS[0] == "avx512vnni"
    if "avx_vnni" in flags:
        assert "avxvnni" in int4_cpu.Q8_PATHS
    if platform.machine() == "x86_64":
        assert "avx2" in int4_cpu.Q8_PATHS


def test_activation_quantization_rounds_per_block_of_32():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.54, 1.0, 32)
    x[1, 32:] = torch.linspace(0.0, 127.0, 32)
    q, d = int4_cpu.quantize_activations(x)

    assert q.dtype == torch.int8 and d.shape == (2, 2)
    assert d[0, 0] == pytest.approx(2.54 / 127) and d[0, 1] == 0 and d[1, 0] == 0
    assert q[0, 0] == -127 and q[1, 63] == 127 and (q[0, 32:] == 0).all()
    back = int4_cpu.dequantize_activations(q, d)
    assert ((back - x).abs() <= d.repeat_interleave(32, 1) / 2 + 1e-7).all()


@pytest.mark.parametrize(("path", "group"), Q8_PATH_GROUPS)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, int4_cpu.MAX_ROWS])
@pytest.mark.parametrize("zero_point", [False, True])
def test_each_int8_activation_build_is_the_int8_math_within_float32_rounding(
    path, group, rows, zero_point
):
    # K an odd multiple of 64 columns where the group allows (the AVX-512 VNNI
    # build's masked last half-step)
    n, k = 37, (3 if group == 64 else 4) * group
    packed, scale, zero_scale = layer(
        n, k, group, seed=group + rows, zero_point=zero_point
    )
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3

    got = run_q8(x, packed, scale, group, zero_scale, path=path)

    # the torch reference of the same math: x rounded to int8 per block, times W
    x_hat = int4_cpu.dequantize_activations(*int4_cpu.quantize_activations(x))
    w = dequantize_weight_int4(packed, scale, group, zero_scale).double()
    want = x_hat.double() @ w.t()
    bound = 1e-5 * (x_hat.double().abs() @ w.abs().t())  # float32 sums' rounding
    assert ((got.double() - want).abs() <= bound).all()
    # and against float activations: x's rounding error (d / 2 a column) times |W|
    _, d = int4_cpu.quantize_activations(x)
    half_step = d.double().repeat_interleave(int4_cpu.Q8_BLOCK, 1) / 2
    float_bound = half_step @ w.abs().t() + 1e-5 * (x.double().abs() @ w.abs().t())
    assert (
        (got.double() - exact(x, packed, scale, group, zero_scale)).abs() <= float_bound
    ).all()


def test_int8_activation_integer_sums_are_exact():
    # x already on the int8 grid with d = 1 (a 127 in each block): the kernel's
    # integer sums times exact scales of 1 are the exact integer result
    group, n, k = 128, 19, 256
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (n, k), generator=g)
    packed = torch.zeros(n, k // 8, dtype=torch.int32)
    for j in range(8):
        packed |= codes[:, j::8].to(torch.int32) << (4 * j)
    scale = torch.ones(n, k // group)
    x = torch.randint(-127, 128, (3, k), generator=g).float()
    x[:, :: int4_cpu.Q8_BLOCK] = 127.0
    want = x.double() @ (codes - 8).double().t()
    for path in int4_cpu.Q8_PATHS:
        assert torch.equal(run_q8(x, packed, scale, group, path=path).double(), want)


def test_int8_activations_split_across_threads_sum_each_row_the_same():
    packed, scale, zero_scale = layer(101, 256, 64, seed=3, zero_point=True)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))

    one = run_q8(x, packed, scale, 64, zero_scale, threads=1)
    for threads in (2, 3, 7, 64):
        assert torch.equal(run_q8(x, packed, scale, 64, zero_scale, threads), one)


def test_a_prepared_weight_runs_int8_activations_when_asked():
    packed, scale, zero_scale = layer(40, 256, 128, seed=12, zero_point=True)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(13))
    prepared = int4_cpu.PreparedInt4(packed, scale, 128, zero_scale)

    assert not prepared.int8_activations and prepared.takes_int8_activations
    assert torch.equal(
        int4_cpu.int4_matmul_prepared(x, prepared),
        int4_cpu.int4_matmul(x, packed, scale, 128, zero_scale),
    )
    prepared.int8_activations = True
    assert torch.equal(
        int4_cpu.int4_matmul_prepared(x, prepared),
        int4_cpu.int4_matmul(x, packed, scale, 128, zero_scale, int8_activations=True),
    )
    assert not int4_cpu.PreparedInt4(packed, scale, 16).takes_int8_activations


def test_int8_activation_refusals_name_the_problem():
    packed, scale, _ = layer(16, 128, 16, seed=7)
    x = torch.randn(1, 128)
    with pytest.raises(ValueError, match="group=16 must be a multiple of 32"):
        run_q8(x, packed, scale, 16)
    packed, scale, _ = layer(16, 128, 32, seed=7)
    with pytest.raises(ValueError, match="avx2 needs a group that is a multiple of 64"):
        run_q8(x, packed, scale, 32, path="avx2")
    with pytest.raises(ValueError, match="no path named avx512"):
        run_q8(x, packed, scale, 32, path="avx512")
