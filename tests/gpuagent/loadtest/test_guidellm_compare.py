"""The guidellm_compare bench's judging, without guidellm or a server: the sweep
goes on until the SLO breaks on both sides, a knee that is only a lower bound or a
run whose client fell behind makes its row INCONCLUSIVE (not PASS or FAIL), and
guidellm's data file holds the texts our plan runner sends."""

import json
from argparse import Namespace
from pathlib import Path

from gpuagent.benches.guidellm_compare import (
    closed_sweep,
    data_file,
    guidellm_command,
    knee_inconclusive,
    level_requests,
    next_level,
    rate_inconclusive,
    rate_plan,
    ratio_row,
    server_rows,
    sweep_plan,
)
from gpuagent.loadtest.client import RequestRecord
from gpuagent.loadtest.metrics import MAX_SCHEDULE_LAG_MS, ClientHealth, load_run
from gpuagent.loadtest.plan_runner import LEVEL_INDEX_STRIDE
from gpuagent.loadtest.sessions import SessionPrompts
from gpuagent.protocol import Lengths, LoadRun, WorkloadPlan

TPOT_MS = 10.0  # every request below streams a token each 10 ms


def run(
    concurrency: int | None = None,
    *,
    meets: bool = True,
    lag_ms: float = 0.0,
    rate: float | None = None,
) -> LoadRun:
    """A measured run of 4 requests (TTFT 20 ms, TPOT 10 ms), judged by an SLO it
    meets or breaks, its client `lag_ms` behind its schedule."""
    records = [
        RequestRecord(
            scheduled_s=i * 0.1,
            start_s=i * 0.1,
            chunk_times_s=[i * 0.1 + 0.02 + k * TPOT_MS / 1e3 for k in range(4)],
            end_s=i * 0.1 + 0.05,
            prompt_tokens=8,
            output_tokens=4,
        )
        for i in range(4)
    ]
    slo_tpot = TPOT_MS * 2 if meets else TPOT_MS / 2
    return load_run(
        records,
        500.0,
        slo_tpot,
        ClientHealth(max_schedule_lag_ms=lag_ms),
        concurrency=concurrency,
        request_rate=rate,
    )


def test_the_runs_are_what_they_say():
    assert run(1).meets_slo and run(1).valid
    assert not run(1, meets=False).meets_slo
    behind = run(rate=2.0, lag_ms=MAX_SCHEDULE_LAG_MS + 1)
    assert not behind.valid and not behind.meets_slo


def test_the_sweep_runs_the_levels_then_doubles_while_either_side_meets_the_slo():
    levels = [1, 2, 4]
    assert next_level(levels, [], [], 64) == 1
    assert next_level(levels, [run(1)], [run(1)], 64) == 2
    ours = [run(1), run(2), run(4)]
    theirs = [run(1), run(2), run(4, meets=False)]
    assert next_level(levels, ours, theirs, 64) == 8  # ours still meets it at 4
    ours += [run(8), run(16, meets=False)]
    theirs += [run(8, meets=False), run(16, meets=False)]
    assert next_level(levels, ours, theirs, 64) is None  # both broke at 16
    assert next_level(levels, ours[:4], theirs[:4], 8) is None  # 16 is past --top


def test_the_sweep_stops_within_the_levels_once_both_broke():
    levels = [1, 2, 4, 8]
    ours, theirs = [run(1), run(2, meets=False)], [run(1), run(2, meets=False)]
    assert next_level(levels, ours, theirs, 64) is None
    assert next_level(levels, ours, [run(1), run(2)], 64) == 4


def test_a_knee_at_the_top_level_is_a_lower_bound_and_inconclusive():
    ours = [run(1), run(2), run(4)]
    theirs = [run(1), run(2), run(4, meets=False)]
    why = knee_inconclusive(ours, theirs, 4)
    assert why == "ours met the SLO up to c=4: a lower bound"
    ours[-1] = run(4, meets=False)
    assert knee_inconclusive(ours, theirs, 4) is None


def test_a_client_behind_at_a_level_up_to_its_break_makes_the_knee_inconclusive():
    ours = [run(1), run(2, lag_ms=MAX_SCHEDULE_LAG_MS + 1), run(4, meets=False)]
    theirs = [run(1), run(2), run(4, meets=False)]
    assert knee_inconclusive(ours, theirs, 4) == "ours client fell behind at c=[2]"
    # past the level where its SLO broke, a lagging client proves nothing
    ours = [run(1), run(2, meets=False), run(4, lag_ms=MAX_SCHEDULE_LAG_MS + 1)]
    assert knee_inconclusive(ours, theirs, 4) is None


def test_a_poisson_round_whose_client_fell_behind_is_inconclusive():
    ok, late = run(rate=5.0), run(rate=5.0, lag_ms=250.0)
    assert rate_inconclusive([ok], [ok]) is None
    why = rate_inconclusive([ok], [late])
    assert why is not None and why.startswith("guidellm client fell behind")
    assert "250 ms late" in why


def test_the_verdict_of_a_ratio_row():
    assert ratio_row("x", 1.0, 1.05)[1] == "PASS"
    assert ratio_row("x", 1.0, 2.0)[1] == "FAIL"
    assert ratio_row("x", None, None)[1] == "FAIL"  # no evidence
    row, verdict = ratio_row("x", 8.26, 0.71, "guidellm client fell behind")
    assert verdict == "INCONCLUSIVE"
    assert "11.634" in row and "guidellm client fell behind" in row
    row, verdict = ratio_row("x", 1.0, 1.0, "ours met the SLO up to c=8")
    assert verdict == "INCONCLUSIVE"  # agreeing lower bounds prove nothing


def test_levels_run_each_stream_at_least_three_times():
    assert level_requests(24, 4) == 24
    assert level_requests(24, 16) == 48


def test_guidellm_reads_the_texts_our_plan_runner_sends(tmp_path):
    work = WorkloadPlan(
        name="compare",
        task="chat",
        language="en",
        prompt=Lengths(tokens=40),
        output=Lengths(tokens=7),
        slo_ttft_p99_ms=500.0,
        slo_tpot_p99_ms=60.0,
    )
    prompts = SessionPrompts(
        work, "", ["Request 000000. one", "Request 000000. two"], [7, 7]
    )
    path = data_file(prompts, 3, tmp_path / "prompts.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"prompt": prompts.user(LEVEL_INDEX_STRIDE + i)[0], "output_tokens_count": 7}
        for i in range(3)
    ]
    assert rows[0]["prompt"] == "Request 010000. one"
    assert rows[1]["prompt"] == "Request 010001. two"


def test_guidellm_reads_a_data_file_and_takes_a_poisson_seed(tmp_path):
    data = tmp_path / "prompts.jsonl"
    out = tmp_path / "out.json"

    def command(data, seed=None):
        return guidellm_command(
            "guidellm", "http://h:1", Path("m"), "kind=poisson,rate=2", 48, 40.0,
            data, out, seed=seed,
        )  # fmt: skip

    file_cmd = command(data, seed=43)
    assert file_cmd[file_cmd.index("--data") + 1] == f"kind=json_file,path={data}"
    assert file_cmd[file_cmd.index("--seed") + 1] == "kind=static,value=43"
    synthetic = command((128, 32))
    assert synthetic[synthetic.index("--data") + 1] == (
        "kind=synthetic_text,prompt_tokens=128,output_tokens=32"
    )
    assert "--seed" not in synthetic  # guidellm's own default


def test_the_server_rows_show_each_sides_steps_hits_and_the_load():
    rows = server_rows(
        [run(4), run(rate=3.0)],
        {"ours": [(120, 3.5), None], "guidellm": [(60, 7.0), (10, 1.0)]},
        {"ours": [0.5, None], "guidellm": [0.25, 0.0]},
        [2.5, 3.25],
    )
    assert len(rows) == 3
    assert rows[1].split() == ["c=4", "120,", "3.5", "/", "60,", "7.0"] + [
        "50%", "/", "25%", "2.5",
    ]  # fmt: skip
    assert rows[2].split()[:2] == ["poisson", "3/s"]
    assert rows[2].split()[2:] == ["-", "/", "10,", "1.0", "-", "/", "0%", "3.2"]


def test_our_plan_runs_each_point_once_as_guidellm_does():
    # a retry of a lagging run sent new (uncached) texts and reported the retry
    work = WorkloadPlan(
        name="compare",
        task="chat",
        language="en",
        prompt=Lengths(tokens=40),
        output=Lengths(tokens=7),
        slo_ttft_p99_ms=500.0,
        slo_tpot_p99_ms=60.0,
    )
    args = Namespace(requests=24, max_seconds=40.0, seed=0, rate_requests=96)
    closed = sweep_plan(args, work, 16).sweeps.concurrency
    assert (closed.levels, closed.requests_per_level, closed.retries) == ([16], 48, 0)
    assert sweep_plan(args, work, 8, 192).sweeps.concurrency.requests_per_level == 192
    plan = rate_plan(args, work, 5.0, seed=3)
    assert (plan.sweeps.rates.retries, plan.seed) == (0, 3)


def test_each_level_is_warmed_at_its_own_level_before_either_side_runs():
    # at c=64 the side that ran first met the cache as c=32 left it (52% of its
    # prompt tokens cached), the second as the first left it (95%)
    calls = []

    class Recording:
        def warm_level(self, concurrency, requests):
            calls.append(("warm", concurrency, requests))

        def ours(self, concurrency):
            calls.append(("ours", concurrency))
            return run(concurrency, meets=concurrency < 16)

        def guidellm(self, concurrency):
            calls.append(("guidellm", concurrency))
            return run(concurrency, meets=concurrency < 32)

    args = Namespace(levels=[4, 8], requests=24, top=64)
    ours, theirs, loads = closed_sweep(args, Recording(), lambda text: None)
    assert [r.concurrency for r in ours] == [4, 8, 16, 32]
    assert [r.concurrency for r in theirs] == [4, 8, 16, 32]
    assert len(loads) == 4
    assert calls == [
        ("warm", 4, 24), ("ours", 4), ("guidellm", 4),
        ("warm", 8, 24), ("guidellm", 8), ("ours", 8),
        ("warm", 16, 48), ("ours", 16), ("guidellm", 16),
        ("warm", 32, 96), ("guidellm", 32), ("ours", 32),
    ]  # fmt: skip
