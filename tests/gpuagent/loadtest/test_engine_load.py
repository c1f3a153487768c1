"""The load tester against the engine serving the demo model: every profile (small
and bounded), and bf16 vs int8 KV in the same KV budget."""

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import pytest

import gpuagent.engine
from gpuagent.engine.cache import kv_bytes_per_token
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.loadtest import Bounds, Costs, Plan, load_profiles, run_load_test
from gpuagent.loadtest.__main__ import main
from gpuagent.loadtest.prompts import PromptSet
from gpuagent.loadtest.runner import Target, run_level
from gpuagent.protocol import LOAD_PROFILES, LoadTestReport
from tests.gpuagent.serving import serve

DEMO = Path(gpuagent.engine.__file__).parent / "demo_model"


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO), load_tokenizer(DEMO)


def test_every_profile_runs_against_the_demo_engine(demo, tmp_path, capsys):
    model, tokenizer = demo
    engine = LLMEngine(model, tokenizer, num_blocks=64, max_model_len=1024)
    out = tmp_path / "load.json"

    with serve(engine, "demo") as (base_url, _):
        argv = ["--endpoint", base_url + "/v1", "--sweep", "2", "--requests", "2"]
        # byte-level: a Korean instruction alone is over 100 tokens
        argv += ["--prompt-tokens", "200", "--output-tokens", "6"]
        argv += ["--gpu-hourly-usd", "2", "--target-rate", "5", "--json", str(out)]
        for name in LOAD_PROFILES:
            argv += ["--profile", name]
        main(argv)

    report = LoadTestReport.model_validate_json(out.read_text())
    table = capsys.readouterr().out
    assert [w.profile for w in report.workloads] == list(LOAD_PROFILES)
    assert report.kv_cache_dtype == "bf16"
    assert report.kv_bytes_per_token == kv_bytes_per_token(model.config, "bf16")
    assert report.kv_budget_bytes == engine.kv.nbytes
    assert report.weights_bytes == sum(
        p.numel() * p.element_size() for p in model.parameters()
    )
    for workload in report.workloads:
        (run,) = workload.runs
        assert (run.num_requests, run.num_errors) == (2, 0), run.errors
        # measured by the server; a cut falls between characters (3 bytes in Korean)
        assert 200 - 3 < run.prompt_tokens <= 200
        assert run.output_tokens == 12  # usage: 6 each
        assert run.ttft_ms.p50 > 0 and run.tpot_ms.p50 > 0
        assert run.peak_concurrent_sequences >= 1
        assert workload.max_sessions_at_context == 64 // 13  # 206 tokens: 13 blocks
        if workload.max_concurrency_at_slo is not None:
            assert workload.cost_per_request == pytest.approx(
                2 / (run.request_throughput * 3600)
            )
            assert workload.gpus_for_target_rate >= 1
        assert workload.profile in table


@contextlib.contextmanager
def all_in_one_step(async_engine, num_requests: int):
    """Hold the engine thread (at its lock) until `num_requests` streams are open:
    they then enter its next step together, a known number running at once."""
    lock = async_engine.engine._lock
    lock.acquire()

    def release_when_all_are_in() -> None:
        deadline = time.monotonic() + 30
        while async_engine.num_live_streams < num_requests:
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)
        lock.release()

    thread = threading.Thread(target=release_when_all_are_in)
    thread.start()
    try:
        yield
    finally:
        thread.join()


@pytest.mark.parametrize(("max_num_seqs", "peak"), [(64, 5), (3, 3)])
def test_the_peak_of_a_short_run_is_exact(demo, max_num_seqs, peak):
    # Five requests of 8 tokens each, all in the engine's first step: a run far
    # shorter than any polling interval, and the scheduler admits min(5, max).
    model, tokenizer = demo
    engine = LLMEngine(model, tokenizer, num_blocks=64, max_num_seqs=max_num_seqs)
    chat = load_profiles()["chat"].with_lengths(prompt_tokens=40, output_tokens=8)
    prompts = PromptSet(chat, ["Say something."] * 5, [40] * 5)

    with serve(engine, "demo") as (base_url, async_engine):
        with all_in_one_step(async_engine, 5):
            run = asyncio.run(
                run_level(Target(base_url, "demo"), prompts, Bounds(5), concurrency=5)
            )

    assert (run.num_requests, run.num_errors) == (5, 0), run.errors
    assert run.peak_concurrent_sequences == peak


def test_int8_kv_admits_more_sessions_than_bf16_in_the_same_budget(demo):
    model, tokenizer = demo
    chat = load_profiles()["chat"].with_lengths(prompt_tokens=200, output_tokens=56)
    # Room for four 256-token sessions at bf16.
    budget = 4 * chat.context_tokens * kv_bytes_per_token(model.config, "bf16")
    plan = Plan(concurrency=[12], bounds=Bounds(requests=12, max_seconds=120))
    reports = {}
    for dtype in ("bf16", "int8"):
        engine = LLMEngine(
            model, tokenizer, kv_cache_dtype=dtype, kv_memory_bytes=budget
        )
        with serve(engine, "demo") as (base_url, _):
            reports[dtype] = asyncio.run(run_load_test(base_url, [chat], plan, Costs()))

    bf16, int8 = (reports[d].workloads[0] for d in ("bf16", "int8"))
    assert reports["int8"].kv_budget_bytes <= budget
    assert reports["bf16"].kv_budget_bytes <= budget
    # int8 is 1 byte per element plus a 4-byte scale per token and head: 0.53x
    assert bf16.max_sessions_at_context == 4
    assert int8.max_sessions_at_context == 7
    assert bf16.runs[0].num_errors == int8.runs[0].num_errors == 0
    # counted by the server while 12 clients pushed: admitted, not computed
    assert (
        int8.runs[0].peak_concurrent_sequences > bf16.runs[0].peak_concurrent_sequences
    )
    assert bf16.runs[0].peak_concurrent_sequences <= bf16.max_sessions_at_context + 1
