"""kernels.matmul_tuning: the fastest matching candidate is recorded per batch
bucket and the public ops launch it; a candidate with another result is never
picked; every candidate computes the reference's result. Under the interpreter on
CPU tensors, with a timer that reads which config ran (the real one needs CUDA)."""

import pytest
import torch

import kernels
from kernels import matmul_tuning, weight_matmul
from kernels.weight_matmul import TileConfig, m_bucket

N, K, GROUP = 48, 256, 128


@pytest.fixture
def launches(monkeypatch):
    """The configs launched, in order; the tuned table emptied before and after."""
    launched: list[TileConfig] = []
    launch = weight_matmul._launch

    def spy(kernel, x, w, scale, n, k, strides, consts, config):
        launched.append(config)
        return launch(kernel, x, w, scale, n, k, strides, consts, config)

    monkeypatch.setattr(weight_matmul, "_launch", spy)
    monkeypatch.setattr(weight_matmul, "TUNED_CONFIGS", {})
    return launched


def timer_by_config(launched, times):
    """A timer that runs fn once and reports the time `times` gives the config it
    launched (1 ms for the others)."""

    def timer(fn):
        fn()
        return times.get(launched[-1], 1.0)

    return timer


def test_it_records_the_fastest_candidate_per_bucket_and_the_ops_launch_it(launches):
    fast = TileConfig(16, 32, 64, 4, 4, split_k=1)
    heuristic = weight_matmul.heuristic_config(4, 1, GROUP)
    assert fast in matmul_tuning.candidate_configs(4, GROUP) and fast != heuristic

    results = matmul_tuning.tune(
        4,
        N,
        K,
        GROUP,
        batches=(1, 3),
        dtype=torch.float32,
        device="cpu",
        timer=timer_by_config(launches, {fast: 0.25}),
    )

    assert [(r.batch, r.config, r.ms, r.heuristic_ms) for r in results] == [
        (1, fast, 0.25, 1.0),
        (4, fast, 0.25, 1.0),
    ]
    assert results[0].candidates == len(matmul_tuning.candidate_configs(4, GROUP))
    w = torch.randn(N, K) * 0.05
    packed, scale = kernels.quantize_weight_int4(w, GROUP)
    for batch, config in ((1, fast), (3, fast), (8, heuristic), (17, None)):
        x = torch.randn(batch, K)
        launches.clear()
        got = kernels.weight_int4_matmul(x, packed, scale, GROUP, impl="triton")
        want = kernels.weight_int4_matmul(x, packed, scale, GROUP, impl="reference")
        expected = config or weight_matmul.heuristic_config(4, batch, GROUP)
        assert launches == [expected]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_it_keeps_the_heuristic_when_no_candidate_is_faster(launches):
    results = matmul_tuning.tune(
        8, N, K, batches=(2,), dtype=torch.float32, device="cpu",
        timer=timer_by_config(launches, {}),
    )  # fmt: skip

    assert results[0].config == weight_matmul.heuristic_config(8, 2, None)
    assert weight_matmul.TUNED_CONFIGS == {(8, 2, N, K, None): results[0].config}


def test_it_never_picks_a_candidate_whose_result_differs(launches, monkeypatch):
    wrong = TileConfig(16, 128, 64, 4, 3, split_k=1)
    launch = weight_matmul._launch

    def broken(kernel, x, w, scale, n, k, strides, consts, config):
        out = launch(kernel, x, w, scale, n, k, strides, consts, config)
        return out * 1.05 if config == wrong else out  # 5% off: a wrong tile

    monkeypatch.setattr(weight_matmul, "_launch", broken)
    candidates = [wrong, TileConfig(16, 32, 128, 4, 3)]
    timer = timer_by_config(launches, {wrong: 0.1, candidates[1]: 0.5})

    results = matmul_tuning.tune(
        4, N, K, GROUP, batches=(1,), dtype=torch.float32, device="cpu",
        timer=timer, candidates=candidates,
    )  # fmt: skip

    assert results[0].config == candidates[1]
    assert results[0].candidates == 1


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_every_candidate_computes_the_references_result(bits, batch):
    # batch 3 runs the bucket-4 gemv tiles with a masked fourth row
    w = torch.randn(N, K) * 0.05
    x = torch.randn(batch, K)
    if bits == 4:
        packed, scale = kernels.quantize_weight_int4(w, GROUP)
        want = kernels.weight_int4_matmul(x, packed, scale, GROUP, impl="reference")
    else:
        q, scale8 = kernels.quantize_weight_int8(w)
        want = kernels.weight_int8_matmul(x, q, scale8, impl="reference")
    group = GROUP if bits == 4 else None

    candidates = matmul_tuning.candidate_configs(bits, group, m_bucket(batch))
    assert any(c.gemv for c in candidates) == (bits == 4 and batch <= 4)
    for config in candidates:
        if bits == 4:
            got = weight_matmul._weight_int4_matmul_triton(
                x, packed, scale, GROUP, config
            )
        else:
            got = weight_matmul._weight_int8_matmul_triton(x, q, scale8, config)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=str(config))


def test_it_refuses_what_it_cannot_tune():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        matmul_tuning.tune(2, N, K, GROUP, device="cpu")
    with pytest.raises(ValueError, match="int4 needs a group_size"):
        matmul_tuning.tune(4, N, K, device="cpu")
    with pytest.raises(ValueError, match="TUNED_MAX_M"):
        matmul_tuning.tune(8, N, K, batches=(32,), device="cpu")
    with pytest.raises(ValueError, match="block_k=256 must divide 128"):
        weight_matmul._weight_int4_matmul_triton(
            torch.randn(1, K), *kernels.quantize_weight_int4(torch.randn(N, K)),
            GROUP, TileConfig(16, 64, 256, 4),
        )  # fmt: skip
