from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from controlplane.dashboard.health import agent_health, job_health

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _agent(silent_s=None, state="online"):
    heartbeat = None if silent_s is None else NOW - timedelta(seconds=silent_s)
    return SimpleNamespace(name="gpu-a1", last_heartbeat=heartbeat, state=state)


def _job(state="running", lease_in_s=60, attempts=1, agent=None):
    lease = None if lease_in_s is None else NOW + timedelta(seconds=lease_in_s)
    return SimpleNamespace(
        state=state, lease_expires=lease, attempts=attempts, agent=agent
    )


def test_it_calls_an_agent_dead_after_its_heartbeats_stop(settings):
    settings.AGENT_DEAD_AFTER_S = 30

    assert agent_health(_agent(silent_s=30), NOW).alive is True
    dead = agent_health(_agent(silent_s=31), NOW)
    assert (dead.alive, dead.label) == (False, "dead")
    assert dead.reason == (
        "missed heartbeats: last seen 31 s ago (dead after 30 s of silence)"
    )


def test_it_reads_the_dead_after_setting(settings):
    settings.AGENT_DEAD_AFTER_S = 300

    assert agent_health(_agent(silent_s=200), NOW).alive is True


def test_it_calls_an_agent_that_never_beat_dead():
    health = agent_health(_agent(silent_s=None), NOW)

    assert (health.alive, health.reason) == (False, "never sent a heartbeat")


def test_it_keeps_offline_and_draining_apart():
    assert agent_health(_agent(5, "offline"), NOW).label == "offline"
    assert agent_health(_agent(5, "draining"), NOW).alive is True


def test_it_leaves_a_healthy_job_alone():
    health = job_health(_job(agent=_agent(5)), NOW)

    assert (health.stuck, health.retried, health.reasons) == (False, False, [])
    assert health.label == ""


def test_it_calls_a_job_with_an_expired_lease_stuck():
    health = job_health(_job(lease_in_s=-180), NOW)

    assert health.stuck and health.label == "stuck"
    assert health.reasons == [
        "lease expired 3 min ago at 2026-01-01 11:57:00 UTC: its worker stopped "
        "renewing it"
    ]


def test_it_calls_a_job_on_a_dead_agent_stuck_before_its_lease_runs_out(settings):
    settings.AGENT_DEAD_AFTER_S = 60
    health = job_health(_job(lease_in_s=600, agent=_agent(silent_s=300)), NOW)

    assert health.stuck
    assert health.reasons == [
        "agent gpu-a1 missed heartbeats: last seen 5 min ago (dead after 60 s of "
        "silence)"
    ]


def test_it_calls_a_second_attempt_retried():
    health = job_health(_job(attempts=3), NOW)

    assert (health.stuck, health.retried, health.label) == (False, True, "retried")
    assert health.reasons == ["attempt 3: 2 earlier attempt(s) did not finish"]


def test_it_never_calls_a_finished_job_stuck():
    health = job_health(_job(state="succeeded", lease_in_s=-60, agent=_agent()), NOW)

    assert health.stuck is False
