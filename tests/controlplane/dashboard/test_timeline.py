from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from controlplane.dashboard.timeline import latest_per_kind, paused_at_gate, stages
from controlplane.releases.timings import overhead

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _gate(outcome):
    return SimpleNamespace(gate="quality", metric="english.mean_kld", outcome=outcome)


def _job(pk, kind, start_s, end_s=None, state=None, result=None, error=""):
    return SimpleNamespace(
        pk=pk,
        kind=kind,
        started=None if start_s is None else T0 + timedelta(seconds=start_s),
        finished=None if end_s is None else T0 + timedelta(seconds=end_s),
        state=state or ("succeeded" if end_s is not None else "running"),
        lease_expires=None,
        attempts=1,
        agent=None,
        result=result if result is not None else {},
        error=error,
    )


PIPELINE = [
    _job(1, "verify_source", 0, 10),
    _job(2, "compress", 10, 60),
    _job(3, "sign", 60, 70),
    _job(4, "verify", 70, 80),
    _job(5, "evaluate", 80, 120),  # evaluate and load_test overlap: 80..130
    _job(6, "load_test", 90, 130),
    _job(7, "gate", 130, 131),
    # a person approves at 131..1000: not machine time
    _job(8, "deploy", 1000, 1019),
    _job(9, "reverify", 5000, 5010),  # after deploy: not on the way to it
]


def test_it_adds_up_machine_time_to_deploy_and_the_checks_share():
    result = overhead(PIPELINE, now=T0 + timedelta(hours=3))

    assert result.deployed is True
    assert result.time_to_deploy_s == pytest.approx(131 + 19)
    assert result.integrity_s == pytest.approx(10 + 10 + 10)
    assert result.tests_s == pytest.approx(50)  # the union, not 40 + 40
    assert result.integrity_share == pytest.approx(30 / 150)
    assert result.tests_share == pytest.approx(50 / 150)


def test_it_counts_a_running_pipeline_up_to_now():
    jobs = [_job(1, "verify_source", 0, 10), _job(2, "evaluate", 10)]

    result = overhead(jobs, now=T0 + timedelta(seconds=25))

    assert result.deployed is False
    assert result.time_to_deploy_s == pytest.approx(25)
    assert result.tests_s == pytest.approx(15)


def test_it_has_no_share_before_anything_ran():
    result = overhead([_job(1, "verify_source", None)], now=T0)

    assert result.time_to_deploy_s == 0
    assert result.integrity_share is None


def test_it_orders_stages_by_start_with_queued_last():
    jobs = [_job(3, "sign", None), _job(2, "compress", 10, 20), _job(1, "verify", 0, 5)]

    ordered = stages(jobs, now=T0)

    assert [s.kind for s in ordered] == ["verify", "compress", "sign"]
    assert [s.duration_s for s in ordered] == [5, 10, None]


def test_it_takes_the_newest_job_of_each_kind_in_pipeline_order():
    jobs = [
        _job(1, "evaluate", 0, 5, state="failed"),
        _job(2, "verify_source", 0, 1),
        _job(3, "evaluate", 6),
    ]

    latest = latest_per_kind(jobs, now=T0 + timedelta(seconds=10))

    assert [(s.kind, s.job.pk) for s in latest] == [
        ("verify_source", 2),
        ("evaluate", 3),
    ]
    assert latest[1].duration_s == 4


def test_it_shows_a_job_that_did_no_work_as_skipped_with_its_reason():
    jobs = [_job(1, "compress", 0, 1, result={"skipped": "compressor not built"})]

    [stage] = stages(jobs, now=T0)

    assert stage.job.state == "succeeded"
    assert (stage.outcome.label, stage.outcome.reason) == (
        "skipped",
        "compressor not built",
    )


def test_it_counts_a_skipped_check_in_no_share_of_the_time_to_deploy():
    jobs = [
        _job(1, "verify_source", 0, 10, result={"skipped": "no verifier"}),
        _job(2, "compress", 10, 30),
        _job(3, "evaluate", 30, 40, result={"skipped": "no evaluator"}),
        _job(4, "load_test", 30, 50),
    ]

    result = overhead(jobs, now=T0 + timedelta(seconds=60))

    assert result.time_to_deploy_s == pytest.approx(50)
    assert result.integrity_s == 0
    assert result.tests_s == pytest.approx(20)


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        (["pass", "fail"], "fail"),
        (["pass", "inconclusive"], "inconclusive"),
        ([], "inconclusive"),
        (["pass", "pass"], "pass"),
    ],
)
def test_it_shows_the_gate_stage_as_its_recorded_results_say(outcomes, expected):
    # The gate job succeeds whenever it got as far as deciding.
    gate = _job(7, "gate", 0, 1, result={"outcome": "pass"})

    [stage] = stages([gate], now=T0, gate_results=[_gate(o) for o in outcomes])

    assert stage.outcome.label == expected
    assert stage.outcome.label != "succeeded"


def test_it_shows_an_older_gate_run_as_its_own_result_said():
    older = _job(1, "gate", 0, 1, result={"outcome": "inconclusive"})
    silent = _job(2, "gate", 2, 3)
    newest = _job(3, "gate", 4, 5)

    shown = stages([older, silent, newest], now=T0, gate_results=[_gate("pass")])

    assert [s.outcome.label for s in shown] == ["inconclusive", "inconclusive", "pass"]


def test_it_knows_a_pipeline_paused_after_its_gate_stage():
    before = [_job(1, "evaluate", 0, 5)]
    deciding = [*before, _job(2, "gate", 5)]
    decided = [*before, _job(2, "gate", 5, 6)]

    assert not paused_at_gate(before)
    assert not paused_at_gate(deciding)
    assert paused_at_gate(decided)
