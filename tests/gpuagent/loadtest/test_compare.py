"""The client comparison's parts without guidellm: the load ours sends to match
guidellm's requests, our numbers by guidellm's definitions against a scripted
server, the server's own latencies, and the table's rows."""

import asyncio

import pytest

from gpuagent.loadtest.compare import (
    ClientRun,
    ServerLatency,
    guidellm_like,
    run_ours,
    split_cores,
    table,
)
from gpuagent.loadtest.prompts import PromptSet
from gpuagent.loadtest.runner import Target, request_body
from tests.gpuagent.loadtest.test_metrics import PROFILE


def client_run(**fields) -> ClientRun:
    values = dict(
        ttft_ms=50.0,
        itl_ms=4.0,
        chunk_gap_ms=None,
        cpu_us_per_token=100.0,
        output_tokens=768,
        prompt_tokens_per_request=134.0,
        output_tokens_per_request=48.0,
        server=ServerLatency(),
    )
    return ClientRun(**{**values, **fields})


def test_it_sends_guidellms_prompt_length_and_no_temperature():
    profile = guidellm_like(PROFILE, text_tokens=128, template_tokens=7)
    body = request_body(Target("http://x", "m"), PromptSet(profile, ["hi"], [135]), 0)

    assert profile.prompt_tokens == 135  # the text plus the chat template
    assert "temperature" not in body  # the server's default, as guidellm leaves it
    assert body["ignore_eos"] and body["max_tokens"] == PROFILE.output_tokens


def test_it_gives_guidellms_itl_per_request_not_the_chunk_gap(scripted):
    # 10 tokens in 5 chunks of 2, 30 ms apart: chunk gaps are 30 ms, but guidellm's
    # ITL, (E2E - TTFT) / (tokens - 1), is 4 * 30 / 9 = 13.3 ms
    flags = ["--ttft-ms", "150", "--itl-ms", "30", "--tokens", "10"]
    with scripted(*flags, "--tokens-per-chunk", "2") as base:
        ours = asyncio.run(run_ours(base, 1, 3, 64, 10))

    assert ours.itl_ms == pytest.approx(4 * 30 / 9, rel=0.15)
    assert ours.chunk_gap_ms == pytest.approx(30, rel=0.15)
    assert 150 <= ours.ttft_ms <= 175
    # the server's own view of the run: 3 first tokens at 150 ms, 3 x 8 later
    # tokens 15 ms apart
    assert (ours.server.ttft_count, ours.server.itl_count) == (3, 24)
    assert ours.server.ttft_mean_ms == pytest.approx(150)
    assert ours.server.itl_mean_ms == pytest.approx(15)


def test_the_itl_held_to_the_target_is_per_request_on_both_sides():
    ours = client_run(itl_ms=4.2, chunk_gap_ms=6.0)
    theirs = client_run(itl_ms=4.0, server=ServerLatency(1.0, 20, 0.3, 100))

    rows = {row.split("  ")[0]: row for row in table([ours], [theirs])}

    itl = rows["median ITL, ms: per request (E2E-TTFT)/(n-1)"]
    assert "4.20" in itl and "4.00" in itl and "1.050" in itl and "PASS" in itl
    assert "PASS" not in rows["median gap between content chunks, ms"]
    server_ttft = rows["server's mean TTFT over the runs, ms"].split()
    assert server_ttft[-2:] == ["-", "50.00"]  # no metrics in ours' run; 1 s / 20


def test_the_engine_gets_its_own_cores_and_the_clients_the_rest():
    assert split_cores({0, 1}, 1) == ({1}, {0})
    assert split_cores({0, 2, 5, 7}, 2) == ({5, 7}, {0, 2})
    assert split_cores({3}, 1) is None  # no core left for the clients: share
    assert split_cores({0, 1}, 2) is None
