"""A flood of refused messages does not grow the audit log without end
(controlplane.fleet.enrollment.do_record_message_refused): per source and kind
of reason, the first refusal in each window is audited in full and the rest
counted, the count audited once when the window has passed, the hash chain
valid throughout."""

from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.management import call_command
from django.utils import timezone

from controlplane.audit.actions import OTHER_REASONS, do_close_event_windows
from controlplane.audit.models import AuditEvent, EventWindow
from controlplane.fleet.enrollment import do_record_message_refused, reason_class
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import record_job_result, run_promotion
from gpuagent.integrity import identity
from gpuagent.protocol import JobRequest, JobResult

FLOOD = 3000
YEAR_S = 365 * 24 * 3600.0


@pytest.fixture
def long_windows(settings):
    """One window spans the whole test (a minute's edge never splits the flood)."""
    settings.RELEASEGATE_REFUSAL_WINDOW_S = YEAR_S
    return settings


def refused_events(verb: str = "agent.message_refused"):
    return AuditEvent.objects.filter(verb=verb).order_by("id")


def forged_result(request: JobRequest, n: int) -> dict:
    return JobResult(
        job_id=request.job_id,
        kind=request.kind,
        ok=True,
        agent=f"agent-{n}",
        started=timezone.now(),
        finished=timezone.now(),
        payload={"ok": True, "n": n},
    ).model_dump(mode="json")


def test_a_flood_of_forged_results_leaves_a_bounded_audit_log_with_the_count(
    release, queued, long_windows
):
    assert run_promotion(release.pk) == "verifying"
    (body, _seal), *_ = queued("run_job")
    request = JobRequest.model_validate(body)
    before = AuditEvent.objects.count()

    outcomes = set()
    for n in range(FLOOD):
        forged = forged_result(request, n)
        if n % 2:  # sealed by a key of its own, a new one each time
            seal = identity.seal(
                Ed25519PrivateKey.generate(),
                forged,
                type="result",
                job_id=request.job_id,
                attempt=request.attempt,
                kind=request.kind,
                release_id=release.pk,
            )
            outcomes.add(record_job_result(forged, request.attempt, seal.model_dump()))
        else:
            outcomes.add(record_job_result(forged, request.attempt))

    assert outcomes == {"refused"}
    first = list(refused_events().values_list("after__reason", flat=True))
    assert first == [
        "unsigned message",
        "sealed by a key no agent is enrolled with",
    ]
    assert AuditEvent.objects.count() - before == 2
    windows = dict(EventWindow.objects.values_list("reason", "count"))
    assert windows == {
        "result: unsigned message": FLOOD // 2,
        "result: sealed by a key no agent is enrolled with": FLOOD // 2,
    }

    closed = do_close_event_windows(now=timezone.now() + timedelta(days=366))

    assert closed == 2
    assert not EventWindow.objects.exists()
    counts = {
        e.after["reason"]: (e.after["count"], e.after["first_event"])
        for e in refused_events("agent.messages_refused")
    }
    first_ids = list(refused_events().values_list("id", flat=True))
    assert counts == {
        "result: unsigned message": (FLOOD // 2, first_ids[0]),
        "result: sealed by a key no agent is enrolled with": (
            FLOOD // 2,
            first_ids[1],
        ),
    }
    assert AuditEvent.objects.count() - before == 4
    call_command("verify_audit_chain")  # raises CommandError on a broken chain
    job = Job.objects.get(pk=request.job_id)
    assert (job.state, job.agent) == ("queued", None)
    assert Release.objects.get(pk=release.pk).state == "verifying"


def test_a_window_with_one_refusal_records_no_count(db, long_windows):
    do_record_message_refused("unsigned message", type="heartbeat")

    assert do_close_event_windows(now=timezone.now() + timedelta(days=366)) == 0

    assert refused_events().count() == 1
    assert not refused_events("agent.messages_refused").exists()
    assert not EventWindow.objects.exists()


def test_each_window_audits_its_first_refusal_in_full(db, settings, monkeypatch):
    settings.RELEASEGATE_REFUSAL_WINDOW_S = 60
    start = timezone.now().replace(second=0, microsecond=0)
    clock = [start + timedelta(seconds=5)]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])

    for _ in range(3):
        do_record_message_refused("unsigned message", type="result")
    clock[0] = start + timedelta(seconds=65)  # the next window: the first closes
    for _ in range(2):
        do_record_message_refused("unsigned message", type="result")

    assert refused_events().count() == 2
    (summary,) = refused_events("agent.messages_refused")
    assert summary.after["count"] == 3
    assert summary.after["window_start"] == start.isoformat()
    assert EventWindow.objects.get().count == 2


def test_a_source_that_varies_its_reason_is_counted_past_the_cap(
    db, long_windows, local_agent
):
    long_windows.RELEASEGATE_REFUSAL_REASONS_PER_WINDOW = 3
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]

    for n in range(60):
        do_record_message_refused(
            f"made up {words[n % 6]}", type="result", agent=local_agent.row
        )

    reasons = list(refused_events().values_list("after__window__reason", flat=True))
    assert reasons == [
        "result: made up alpha",
        "result: made up bravo",
        "result: made up charlie",
        OTHER_REASONS,
    ]
    windows = dict(EventWindow.objects.values_list("reason", "count"))
    assert sum(windows.values()) == 60
    assert windows[OTHER_REASONS] == 30


@pytest.mark.parametrize(
    "reason, kind",
    [
        ("stale: sealed +900 s from now (at most 300 s either way)", "stale"),
        (
            "the seal binds job_id=3, the message 4",
            "the seal binds job_id=N, the message N",
        ),
        (
            "the seal binds kind='x; y', the message 'z'",
            "the seal binds kind='…', the message '…'",
        ),
        (
            f"sealed by {'ab' * 8}, not by the expected key",
            "sealed by …, not by the expected key",
        ),
        ("malformed result: 1 validation error for JobResult", "malformed result"),
    ],
)
def test_a_reason_is_classed_without_what_the_message_put_in_it(reason, kind):
    assert reason_class(reason) == kind
