"""Metric definitions: exact on hand-made records, and measured against a scripted
server with known timings (role-only first chunk, several tokens per chunk)."""

import asyncio

import pytest

from gpuagent.loadtest.client import RequestRecord
from gpuagent.loadtest.metrics import ClientHealth, load_run
from gpuagent.loadtest.profiles import Profile
from gpuagent.loadtest.prompts import PromptSet
from gpuagent.loadtest.runner import Bounds, Target, run_level

PROFILE = Profile("t", "english", "Answer.", prompt_tokens=20, output_tokens=10)


def record(start, chunks, tokens, error=""):
    return RequestRecord(
        start_s=start,
        chunk_times_s=list(chunks),
        end_s=(chunks[-1] if chunks else start) + 0.001,
        prompt_tokens=20,
        output_tokens=tokens,
        error=error,
    )


def test_it_computes_ttft_tpot_itl_e2e_and_goodput_exactly():
    records = [
        # TTFT 0.1, E2E 0.3, 5 tokens: TPOT 0.05; ITLs 0.1, 0.1
        record(0.0, [0.1, 0.2, 0.3], 5),
        # TTFT 0.5 (over a 400 ms SLO), E2E 0.6, 3 tokens: TPOT 0.05; ITL 0.1
        record(1.0, [1.5, 1.6], 3),
        record(2.0, [], 0, error="HTTP 500: boom"),
    ]

    run = load_run(records, 400.0, 60.0, ClientHealth(), concurrency=2)

    assert run.num_requests == 2 and run.num_errors == 1
    assert run.errors == ["HTTP 500: boom"]
    assert run.ttft_ms.p50 == pytest.approx(300.0)  # of 100 and 500
    assert run.ttft_ms.p99 == pytest.approx(100 + 0.99 * 400)
    assert run.tpot_ms.p50 == pytest.approx(50.0)
    assert run.itl_ms.p50 == pytest.approx(100.0) and run.itl_ms.p99 == pytest.approx(
        100.0
    )
    assert run.e2e_ms.p50 == pytest.approx(450.0)
    assert run.duration_s == pytest.approx(2.001)  # first send -> last end
    assert run.request_throughput == pytest.approx(2 / 2.001)
    assert run.output_tokens_per_s == pytest.approx(8 / 2.001)
    assert run.goodput == pytest.approx(1 / 2.001)  # only the first met both
    assert run.output_tokens == 8 and run.prompt_tokens == 20
    assert not run.meets_slo  # p99 TTFT over, and an error


def test_a_client_that_fell_behind_makes_the_run_invalid():
    records = [record(0.0, [0.1, 0.2], 2)]

    late = load_run(records, 1e4, 1e4, ClientHealth(max_schedule_lag_ms=250.0))
    laggy = load_run(records, 1e4, 1e4, ClientHealth(loop_lag_p99_ms=80.0))
    fine = load_run(records, 1e4, 1e4, ClientHealth(cpu_s=0.002))

    assert not late.valid and not late.meets_slo
    assert not laggy.valid
    assert fine.valid and fine.meets_slo
    assert fine.client_cpu_us_per_token == pytest.approx(1000.0)


def prompts(n: int = 1) -> PromptSet:
    return PromptSet(PROFILE, ["Request 000000. Hello."] * n, [20] * n)


def test_it_measures_a_scripted_stream_as_scripted(scripted):
    # Role chunk at once; content 150 ms after arrival, then every 30 ms; 10 tokens
    # in 5 chunks of 2: TTFT 150, ITL 30, E2E 150 + 4 * 30, TPOT 4 * 30 / 9.
    flags = ["--ttft-ms", "150", "--itl-ms", "30", "--tokens", "10"]
    with scripted(*flags, "--tokens-per-chunk", "2") as base:
        run = asyncio.run(
            run_level(Target(base, "scripted"), prompts(), Bounds(4), concurrency=1)
        )

    assert run.num_requests == 4 and run.num_errors == 0
    assert run.output_tokens == 40  # from usage, not 5 chunks
    assert 150 <= run.ttft_ms.p50 <= 175  # not the role chunk at ~0 ms
    assert 30 - 10 <= run.itl_ms.p50 <= 30 + 10
    assert 270 <= run.e2e_ms.p50 <= 300
    assert run.tpot_ms.p50 == pytest.approx(
        (run.e2e_ms.p50 - run.ttft_ms.p50) / 9, rel=0.15
    )
    assert 120 / 9 - 2 <= run.tpot_ms.p50 <= 120 / 9 + 2
