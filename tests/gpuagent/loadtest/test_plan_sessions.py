"""Session workloads against the engine serving the demo model (prefix caching on):
the hit rate the server reports matches what the plan's session model implies,
and a plan with no reuse gets (almost) none; and the implied count itself on a
hand-made level."""

import asyncio
from pathlib import Path

import pytest

import gpuagent.engine
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.loadtest.client import RequestRecord
from gpuagent.loadtest.plan_runner import run_plan
from gpuagent.loadtest.sessions import LevelRecords, Turn, implied_cached_tokens
from gpuagent.protocol import LoadPlan
from tests.gpuagent.serving import serve

DEMO = Path(gpuagent.engine.__file__).parent / "demo_model"


def workload(name: str, turns: int, system: int, carry: bool = True) -> dict:
    return {
        "name": name,
        "task": "chat",
        "language": "en",
        "prompt": {"tokens": 96, "spread": 0.2},
        "output": {"tokens": 4},  # under one 16-token block
        "session": {
            "turns": turns,
            "system_prompt_tokens": system,
            "carry_history": carry,
        },
    }


def test_the_servers_hit_rate_matches_what_the_session_model_implies():
    engine = LLMEngine(
        load_model(DEMO), load_tokenizer(DEMO), num_blocks=512, max_model_len=2048
    )
    plan = LoadPlan.model_validate(
        {
            "workloads": [
                workload("sessions", turns=4, system=128),
                workload("single", turns=1, system=0),
            ],
            "sweeps": {
                "concurrency": {"mode": "stepped", "levels": [1, 2]},
                "context": None,
            },
            "budget_s": 120,
        }
    )
    with serve(engine, "demo") as (url, _):
        report = asyncio.run(run_plan(url, plan))

    sessions, single = report.workloads
    for run in sessions.runs:
        assert run.num_errors == 0 and run.prefix_cache_hit_rate_source == "metrics"
        # carried history and a shared system prompt: most of each prompt
        assert run.implied_prefix_cache_hit_rate > 0.5
        assert run.prefix_cache_hit_rate == pytest.approx(
            run.implied_prefix_cache_hit_rate, abs=0.06
        )
        # the server's two reports of it agree: /metrics and usage.cached_tokens
        assert run.cached_tokens == pytest.approx(
            run.prefix_cache_hit_rate * run.prompt_tokens * run.num_requests, rel=0.05
        )
        assert run.kv_blocks_used_peak >= 0
    for run in single.runs:  # distinct prompts: at most the template's opening
        assert run.prefix_cache_hit_rate < 0.2
        assert run.prefix_cache_hit_rate == pytest.approx(
            run.implied_prefix_cache_hit_rate, abs=0.15
        )
    assert sessions.turns_per_session == 4 and sessions.system_prompt_tokens == 128


def test_the_context_sweep_goes_up_to_the_servers_max_model_len():
    engine = LLMEngine(
        load_model(DEMO), load_tokenizer(DEMO), num_blocks=256, max_model_len=1024
    )
    rag = workload("rag", turns=1, system=0) | {
        "task": "rag",
        "prompt": {"tokens": 200},
    }
    plan = LoadPlan.model_validate(
        {
            "workloads": [rag],
            "sweeps": {
                "concurrency": None,
                "context": {
                    "context_tokens": [4096, 256, "max_model_len"],
                    "requests_per_level": 2,
                },
            },
            "budget_s": 120,
        }
    )
    with serve(engine, "demo") as (url, _):
        report = asyncio.run(run_plan(url, plan))

    (workload_report,) = report.workloads
    runs = workload_report.context_sweep
    # prompt + answer per request: 252 + 4 and 1020 + 4 (a cut falls between bytes)
    assert [r.prompt_tokens + 4 for r in runs] == [256, 1024]
    assert all(r.num_requests == 2 and r.num_errors == 0 for r in runs)
    assert report.max_model_len == 1024
    assert report.unmeasured == ["rag 4096 tok: over the server's max_model_len"]


def record(start: float, first: float, prompt: int) -> RequestRecord:
    return RequestRecord(
        start_s=start,
        chunk_times_s=[first, first + 0.1],
        end_s=first + 0.1,
        prompt_tokens=prompt,
        output_tokens=2,
    )


def test_it_implies_the_full_blocks_of_the_prefix_a_request_shares():
    level = LevelRecords(
        turns=[
            Turn(record(0.0, 1.0, 50), session=0, turn=0),  # cold
            Turn(record(0.5, 1.5, 50), session=1, turn=0),  # sent before any prefill
            Turn(record(2.0, 3.0, 90), session=0, turn=1),  # history: 50 -> 48
            Turn(record(2.0, 3.0, 52), session=2, turn=0),  # opening 40 -> 32
            Turn(record(4.0, 5.0, 96), session=0, turn=2),  # 90 -> 80; at most 95
        ]
    )
    assert implied_cached_tokens(level, 40, 16, carry=True) == [0, 0, 48, 32, 80]
    assert implied_cached_tokens(level, 40, 16, carry=False) == [0, 0, 32, 32, 32]
    warm = implied_cached_tokens(level, 40, 16, carry=True, opening_cached=True)
    assert warm == [32, 32, 48, 32, 80]
