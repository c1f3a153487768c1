"""The server's side of prefix caching, run for real (uvicorn on 127.0.0.1):
OpenAI's `usage.prompt_tokens_details.cached_tokens` in completions and chat
completions, streamed too; the prefix-cache counters under vLLM's names in /metrics;
and the `x-session-affinity` header, accepted and recorded."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

import gpuagent.engine
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.tokenizer import load_tokenizer
from tests.gpuagent.serving import metric, serve, sse_events

DEMO_DIR = Path(gpuagent.engine.__file__).parent / "demo_model"
BLOCK_SIZE = 16
SYSTEM = (
    "You are the release assistant. Answer in one short sentence, name the release "
    "you mean, and say when you do not know. Releases are promoted by the gate."
)


@pytest.fixture(scope="module")
def served():
    """(base URL, LLMEngine) of a live server over the demo model."""
    engine = LLMEngine(
        load_model(DEMO_DIR),
        load_tokenizer(DEMO_DIR),
        num_blocks=64,
        block_size=BLOCK_SIZE,
    )
    with serve(engine, "demo") as (base_url, _):
        yield base_url, engine


def post(base_url: str, path: str, body: dict, **headers: str) -> dict:
    response = httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def full_blocks_shared(first: list[int], second: list[int]) -> int:
    """Tokens of `second` in full blocks that `first` computed, short of its last
    token (always computed)."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    shared = min(shared, len(second) - 1)
    return shared // BLOCK_SIZE * BLOCK_SIZE


def test_it_reports_the_cached_prompt_tokens_of_a_completion(served):
    base_url, _ = served
    first = {"model": "demo", "prompt": SYSTEM + " Which release?", "max_tokens": 3}
    second = {**first, "prompt": SYSTEM + " Who approved it?"}
    ids = [
        post(base_url, "/tokenize", {"prompt": body["prompt"]})["tokens"]
        for body in (first, second)
    ]

    cold = post(base_url, "/v1/completions", first)["usage"]
    warm = post(base_url, "/v1/completions", second)["usage"]

    assert cold["prompt_tokens_details"] == {"cached_tokens": 0}
    expected = full_blocks_shared(ids[0], ids[1])
    assert expected >= 8 * BLOCK_SIZE
    assert warm["prompt_tokens_details"] == {"cached_tokens": expected}
    assert warm["prompt_tokens"] == len(ids[1])


def test_it_reports_the_cached_prompt_tokens_of_a_chat_streamed_or_not(served):
    base_url, _ = served
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which release is live?"},
    ]
    body = {"model": "demo", "messages": messages, "max_tokens": 4}
    ids = post(base_url, "/tokenize", {"messages": messages})["tokens"]
    post(base_url, "/v1/chat/completions", body)

    again = post(base_url, "/v1/chat/completions", {**body, "n": 2})["usage"]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=stream, timeout=60
    ) as response:
        events = list(sse_events(response.iter_lines()))

    expected = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    # n choices of one prompt count its cached tokens once, as its prompt tokens
    assert again["prompt_tokens_details"] == {"cached_tokens": expected}
    assert again["prompt_tokens"] == len(ids)
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": expected}


def test_it_counts_prefix_cache_queries_and_hits_under_ours_and_vllms_names(served):
    base_url, engine = served
    before = {
        name: metric(base_url, name)
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    }
    body = {"model": "demo", "prompt": SYSTEM + " Counted?", "max_tokens": 2}
    num_prompt = len(post(base_url, "/tokenize", {"prompt": body["prompt"]})["tokens"])

    usage = post(base_url, "/v1/completions", body)["usage"]

    cached = usage["prompt_tokens_details"]["cached_tokens"]
    queries = metric(base_url, "vllm:prefix_cache_queries_total")
    hits = metric(base_url, "vllm:prefix_cache_hits_total")
    assert queries - before["vllm:prefix_cache_queries_total"] == num_prompt
    assert hits - before["vllm:prefix_cache_hits_total"] == cached
    assert metric(base_url, "engine_prefix_cache_hits_total") == hits
    assert metric(base_url, "engine_prefix_cache_queries_total") == queries


def test_it_accepts_and_records_the_session_affinity_header(served, caplog):
    base_url, _ = served
    before = metric(base_url, "engine_session_affinity_requests_total")
    body = {"model": "demo", "prompt": "hello", "max_tokens": 2}
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}

    with caplog.at_level(logging.INFO, logger="gpuagent.engine.server"):
        post(base_url, "/v1/completions", body, **{"x-session-affinity": "sess-42"})
        post(base_url, "/v1/chat/completions", {**chat, "max_tokens": 2})
        post(
            base_url,
            "/v1/chat/completions",
            {**chat, "max_tokens": 2},
            **{"X-Session-Affinity": "sess-43"},
        )

    assert metric(base_url, "engine_session_affinity_requests_total") == before + 2
    # logged as JSON beside user and metadata, so no value can forge a line
    assert 'session "sess-42"' in caplog.text and 'session "sess-43"' in caplog.text
