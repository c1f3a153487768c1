"""Load levels against scripted servers: errors reported not raised, 256 streams on
one core, an open-loop client that falls behind, seeded arrivals, profiles, request
bodies."""

import asyncio
import os
import time
from dataclasses import replace

import numpy as np
import pytest

from gpuagent.loadtest.__main__ import main
from gpuagent.loadtest.profiles import ProfileError, load_profiles
from gpuagent.loadtest.runner import (
    Bounds,
    Target,
    arrival_times,
    request_body,
    run_level,
)
from gpuagent.protocol import LOAD_PROFILES
from tests.gpuagent.loadtest.test_metrics import prompts
from tests.gpuagent.serving import free_port


def test_a_bad_endpoint_is_a_run_of_errors_not_a_crash():
    target = Target(f"http://127.0.0.1:{free_port()}", "x", timeout_s=5)

    run = asyncio.run(run_level(target, prompts(), Bounds(3), concurrency=2))

    assert (run.num_requests, run.num_errors) == (0, 3)
    assert run.errors and "Connect" in run.errors[0]
    assert not run.meets_slo


def test_the_cli_names_an_unreachable_endpoint():
    with pytest.raises(SystemExit, match="not reachable"):
        main(["--endpoint", f"http://127.0.0.1:{free_port()}", "--profile", "chat"])


def test_server_failures_mid_run_are_counted_as_errors(scripted):
    flags = ["--ttft-ms", "5", "--itl-ms", "2", "--tokens", "4"]
    flags += ["--fail-every", "3", "--cut-every", "4", "--error-event-every", "5"]
    with scripted(*flags) as base:
        run = asyncio.run(
            run_level(Target(base, "scripted"), prompts(), Bounds(30), concurrency=1)
        )

    # of 1..30: 10 multiples of 3 answer 500; 4, 8, 16, 20, 28 are cut mid-stream;
    # 5, 10, 25 send an error event
    assert (run.num_requests, run.num_errors) == (12, 18)
    assert any(e.startswith("HTTP 500") for e in run.errors)
    assert any("error event" in e for e in run.errors)
    assert any("[DONE]" in e or "Payload" in e or "Connection" in e for e in run.errors)
    assert not run.meets_slo


def test_it_streams_256_at_once_on_one_core(scripted):
    cpu = sorted(os.sched_getaffinity(0))[0]
    flags = ["--ttft-ms", "200", "--itl-ms", "25", "--tokens", "16"]
    with scripted(*flags) as base:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})  # the client (this process) on one core
        try:
            run = asyncio.run(
                run_level(
                    Target(base, "scripted"), prompts(), Bounds(256), concurrency=256
                )
            )
        finally:
            os.sched_setaffinity(0, before)

    assert (run.num_requests, run.num_errors) == (256, 0)
    assert run.output_tokens == 256 * 16
    assert 200 <= run.peak_concurrent_sequences <= 256  # the server had them together
    # The client's own overhead is measured and reported; how small it is, is a
    # speed number for the benchmark (python -m gpuagent.loadtest.compare prints CPU
    # per streamed token beside guidellm's), not for a timed test on a shared CPU.
    assert run.client_cpu_s > 0 and run.client_cpu_us_per_token > 0
    assert run.client_cpu_s <= run.duration_s * 1.05 + 0.05  # one core at most


def test_an_open_loop_client_that_falls_behind_is_marked_invalid(scripted):
    with scripted("--ttft-ms", "5", "--itl-ms", "1", "--tokens", "2") as base:
        stalled = asyncio.run(
            run_level(
                Target(base, "scripted"),
                prompts(),
                Bounds(12),
                rate=100.0,
                on_done=lambda _: time.sleep(0.15),  # blocks the event loop
            )
        )
        kept_up = asyncio.run(
            run_level(Target(base, "scripted"), prompts(), Bounds(6), rate=20.0)
        )

    assert stalled.max_schedule_lag_ms > 100 and not stalled.valid
    assert not stalled.meets_slo
    assert stalled.arrival == "poisson" and stalled.request_rate == 100.0
    assert kept_up.num_requests == 6 and kept_up.max_schedule_lag_ms < 100


def test_arrivals_are_seeded_poisson_or_gamma():
    poisson = arrival_times(10.0, 4000, seed=1)
    again = arrival_times(10.0, 4000, seed=1)
    bursty = arrival_times(10.0, 4000, seed=1, burstiness=0.25)

    gaps, bursty_gaps = np.diff(poisson), np.diff(bursty)
    assert np.array_equal(poisson, again) and poisson[0] == 0
    assert gaps.mean() == pytest.approx(0.1, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential
    assert bursty_gaps.mean() == pytest.approx(0.1, rel=0.1)
    assert bursty_gaps.std() / bursty_gaps.mean() == pytest.approx(2.0, rel=0.15)


def test_the_shipped_profiles_are_the_six_workloads(tmp_path):
    profiles = load_profiles()
    bad = tmp_path / "p.toml"
    bad.write_text(
        '[profiles.x]\nsource = "english"\ninstruction = "a"\n'
        "prompt_tokens = 5\noutput_tokens = 5\ncolour = 1\n"
    )

    assert tuple(profiles) == LOAD_PROFILES
    assert profiles["rag"].prompt_tokens > profiles["code"].prompt_tokens
    assert profiles["code"].output_tokens > profiles["chat"].output_tokens
    assert profiles["chat-ko"].source == "korean"
    with pytest.raises(ProfileError, match="colour"):
        load_profiles(bad)


def test_it_sends_the_profiles_temperature_or_leaves_it_to_the_server():
    target = Target("http://x", "m")
    sampled = replace(prompts().profile, temperature=None)

    greedy_body = request_body(target, prompts(), 0)
    sampled_body = request_body(target, replace(prompts(), profile=sampled), 0)

    assert greedy_body["temperature"] == 0.0  # the default: the same answer each run
    assert "temperature" not in sampled_body  # the server samples at its default


@pytest.mark.parametrize(
    ("value", "problem"), [('"hot"', "must be a number"), ("-0.5", "at least 0")]
)
def test_a_profile_temperature_that_is_not_a_temperature_is_refused(
    tmp_path, value, problem
):
    bad = tmp_path / "p.toml"
    bad.write_text(
        '[profiles.x]\nsource = "english"\ninstruction = "a"\n'
        f"prompt_tokens = 5\noutput_tokens = 5\ntemperature = {value}\n"
    )

    with pytest.raises(ProfileError, match=problem):
        load_profiles(bad)
