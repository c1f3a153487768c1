"""The group-wise int8 CPU kernel (kernels.int8_cpu) against exact arithmetic, its
quantizer (Q8_0's rule: a Q8_0 matrix comes back exactly), the blocked prefill path,
and its refusals."""

import platform

import pytest
import torch

from kernels import _int8_cpu, int8_cpu


def layer(n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    return int8_cpu.quantize_int8(w, group)


def exact(x, codes, scale):
    return x.double() @ int8_cpu.dequantize_int8(codes, scale).double().t()


def bound(x, codes, scale):
    """float32 sums' rounding of |x| . |W|"""
    w = int8_cpu.dequantize_int8(codes, scale).double()
    return 1e-5 * (x.double().abs() @ w.abs().t())


def run(x, codes, scale, threads=1, path=None, group=None):
    """The extension called directly, N (and by default the group) taken from the
    scales."""
    (m, k), n = x.shape, scale.shape[0]
    group = group or k // scale.shape[1]
    y = torch.empty(m, n)
    args = (x.numpy(), codes.numpy(), scale.numpy(), y.numpy())
    _int8_cpu.int8_matmul(*args, m, n, k, group, threads, path)
    return y


def test_it_is_built_here_with_a_simd_build_for_this_x86_cpu():
    assert int8_cpu.AVAILABLE
    assert int8_cpu.PATHS[-1] == "portable"
    if platform.machine() == "x86_64":  # every x86-64 CPU here has AVX2
        assert "avx2" in int8_cpu.PATHS


GROUPS = [8, 16, 32, 64, 576]
# The AVX-512 build takes 16 codes per step (a group that is a multiple of 16).
PATH_GROUPS = [
    (path, group)
    for path in int8_cpu.PATHS
    for group in GROUPS
    if path != "avx512" or group % 16 == 0
]


@pytest.mark.parametrize(("path", "group"), PATH_GROUPS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, int8_cpu.MAX_ROWS])
def test_each_build_matches_exact_arithmetic_within_float32_rounding(path, group, rows):
    n, k = 37, 2 * group if group < 576 else group  # an odd number of rows
    codes, scale = layer(n, k, group, seed=group + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))

    got = run(x, codes, scale, path=path)

    assert (
        (got.double() - exact(x, codes, scale)).abs() <= bound(x, codes, scale)
    ).all()


@pytest.mark.parametrize("path", int8_cpu.PATHS)
@pytest.mark.parametrize("rows", [9, int8_cpu.MAX_ROWS])
def test_many_rows_of_w_and_x_go_in_blocks_to_the_same_sums(path, rows):
    # more rows of W than one block (64) and of x than one chunk (8): each y[m, n]
    # is still the one sum of row m of x and row n of W
    codes, scale = layer(200, 96, 32, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(10))

    got = run(x, codes, scale, threads=3, path=path)

    assert (
        (got.double() - exact(x, codes, scale)).abs() <= bound(x, codes, scale)
    ).all()
    one_by_one = torch.cat(
        [run(x[i : i + 1], codes, scale, path=path) for i in range(rows)]
    )
    assert torch.equal(got, one_by_one)


@pytest.mark.parametrize("group", GROUPS)
def test_the_default_is_the_best_build_that_takes_the_group(group):
    codes, scale = layer(29, 2 * group, group, seed=8)
    x = torch.randn(2, 2 * group, generator=torch.Generator().manual_seed(9))
    best = next(p for p, g in PATH_GROUPS if g == group)

    assert torch.equal(
        int8_cpu.int8_matmul(x, codes, scale), run(x, codes, scale, path=best)
    )


def test_each_row_of_w_is_summed_the_same_on_any_number_of_threads():
    codes, scale = layer(101, 256, 32, seed=3)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))

    one = run(x, codes, scale, threads=1)
    for threads in (2, 3, 7, 64):
        assert torch.equal(run(x, codes, scale, threads), one)


def test_a_q8_0_matrix_is_quantized_back_exactly():
    # what a GGUF's Q8_0 tensor dequantizes to: codes in -127..127 (one of them
    # +-127 per group) times a float16 scale
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (64, 96), generator=g, dtype=torch.int8)
    codes[:, ::32] = 127
    scale = (torch.rand(64, 3, generator=g) * 0.01).half().float()
    w = int8_cpu.dequantize_int8(codes, scale)

    again_codes, again_scale = int8_cpu.quantize_int8(w, 32)

    assert torch.equal(again_codes, codes) and torch.equal(again_scale, scale)
    assert torch.equal(int8_cpu.dequantize_int8(again_codes, again_scale), w)


def test_rounding_is_symmetric_to_nearest_and_a_zero_group_stays_zero():
    w = torch.tensor([[127.0, -63.4, 0.4, -127.0], [0.0, 0.0, 0.0, 0.0]])

    codes, scale = int8_cpu.quantize_int8(w, 4)

    assert codes.tolist() == [[127, -63, 0, -127], [0, 0, 0, 0]]
    assert scale.tolist() == [[1.0], [0.0]]


def test_the_blocked_path_is_the_dequantized_matmul_at_any_rows(monkeypatch):
    monkeypatch.setattr(int8_cpu, "BLOCK_ROWS", 16)  # several blocks and a partial one
    codes, scale = layer(40, 64, 32, seed=6)
    w = int8_cpu.dequantize_int8(codes, scale)
    for shape in [(1, 64), (int8_cpu.MAX_ROWS + 7, 64), (2, 5, 64)]:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(7))

        assert torch.allclose(
            int8_cpu.int8_matmul_blocked(x, codes, scale), x @ w.t(), atol=1e-5
        )


def test_a_buffer_of_the_wrong_size_or_a_bad_group_is_refused_by_name():
    codes, scale = layer(16, 128, 32, seed=6)
    x = torch.randn(1, 128)
    with pytest.raises(ValueError, match="scale holds"):
        run(x, codes, scale[:, :1].contiguous(), group=32)
    with pytest.raises(ValueError, match="codes holds"):
        run(x, codes[:8].contiguous(), scale)
    with pytest.raises(ValueError, match="group=12"):
        out = torch.empty(1, 16).numpy()
        _int8_cpu.int8_matmul(x.numpy(), codes.numpy(), scale.numpy(), out,
                              1, 16, 120, 12, 1)  # fmt: skip
    with pytest.raises(ValueError, match="m=17"):
        run(torch.randn(17, 128), codes, scale)
    with pytest.raises(ValueError, match="no path named sse9"):
        run(x, codes, scale, path="sse9")
    with pytest.raises(ValueError, match="does not divide 128 columns"):
        int8_cpu.quantize_int8(torch.randn(4, 128), 48)


def test_a_build_that_cannot_take_the_group_is_refused_by_name():
    codes, scale = layer(16, 64, 8, seed=7)
    x = torch.randn(1, 64)
    if "avx512" in int8_cpu.PATHS:
        with pytest.raises(ValueError, match="avx512 needs a group that is a multiple"):
            run(x, codes, scale, path="avx512")
    for path in {"avx512", "avx2"} - set(int8_cpu.PATHS):
        with pytest.raises(ValueError, match=f"{path} does not run on this CPU"):
            run(x, codes, scale, path=path)
