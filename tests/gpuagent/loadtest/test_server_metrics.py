"""Reading /metrics: the peak of concurrent sequences between two readings of the
engine's per-step histogram, exact whatever ran before; unknown (0) without it; and
the steps run between them with their mean batch."""

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from gpuagent.loadtest.server_metrics import (
    parse_metrics,
    peak_running,
    running_steps,
)
from tests.gpuagent.loadtest.scripted_server import running_per_step_histogram


def running_per_step(max_num_seqs: int = 8) -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, running_per_step_histogram(registry, max_num_seqs)


def reading(registry: CollectorRegistry):
    return parse_metrics(generate_latest(registry).decode())


def test_it_takes_the_peak_of_the_steps_between_two_readings():
    registry, steps = running_per_step()
    for running in (7, 8, 3):  # earlier traffic, higher than the run's
        steps.observe(running)
    before = reading(registry)
    for running in (1, 2, 2, 1, 0):
        steps.observe(running)
        reading(registry)  # another scraper meanwhile changes nothing

    after = reading(registry)

    assert peak_running(before, after) == 2
    assert peak_running(after, after) == 0  # no step between them


def test_one_step_at_the_top_bucket_is_the_peak():
    registry, steps = running_per_step(max_num_seqs=4)
    before = reading(registry)
    steps.observe(1)
    steps.observe(4)

    assert peak_running(before, reading(registry)) == 4


def test_without_the_histogram_or_across_a_restart_the_peak_is_unknown():
    registry, steps = running_per_step()
    steps.observe(5)
    before = reading(registry)
    restarted, again = running_per_step()
    again.observe(2)
    gauge_only = CollectorRegistry()  # what vLLM exports: the running count now
    Gauge("vllm:num_requests_running", "Running", registry=gauge_only).set(5)

    assert peak_running(before, reading(restarted)) == 0
    assert peak_running(reading(gauge_only), reading(gauge_only)) == 0
    assert peak_running(before, parse_metrics("")) == 0  # a reading failed
    assert peak_running(parse_metrics(""), before) == 0


def test_the_steps_between_two_readings_and_their_mean_batch():
    registry, steps = running_per_step()
    for running in (8, 8, 8):  # earlier traffic
        steps.observe(running)
    before = reading(registry)
    for running in (1, 2, 3, 0, 6):  # an idle step (0) is not counted
        steps.observe(running)

    assert running_steps(before, reading(registry)) == (4, 3.0)
    assert running_steps(before, before) == (0, 0.0)


def test_a_burst_reads_as_few_steps_of_many_sequences():
    # the same 4 requests of 3 tokens each: spread out (one at a time) or at once
    spread, one = running_per_step()
    burst, all_at_once = running_per_step()
    before_spread, before_burst = reading(spread), reading(burst)
    for _ in range(12):
        one.observe(1)
    for _ in range(3):
        all_at_once.observe(4)

    assert running_steps(before_spread, reading(spread)) == (12, 1.0)
    assert running_steps(before_burst, reading(burst)) == (3, 4.0)


def test_without_the_histogram_or_across_a_restart_the_steps_are_unknown():
    registry, steps = running_per_step()
    steps.observe(5)
    before = reading(registry)
    restarted, again = running_per_step()
    again.observe(2)

    assert running_steps(before, reading(restarted)) is None
    assert running_steps(before, parse_metrics("")) is None
