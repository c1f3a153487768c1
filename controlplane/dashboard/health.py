"""Is a job stuck, was it retried, is an agent dead: pure functions over rows and a
clock, so every page says it the same way and the tests can set the clock.

A running job is stuck when its lease has run out (its worker stopped renewing it) or
when the agent running it has missed its heartbeats. A job on its second or later
attempt is retried. An agent is dead when its last heartbeat is older than
AGENT_DEAD_AFTER_S (default 30 s: a death is to be noticed within a minute) or it
never sent one.
"""

from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings


def agent_dead_after_s() -> int:
    return settings.AGENT_DEAD_AFTER_S


@dataclass(frozen=True)
class AgentHealth:
    alive: bool
    label: str  # "alive" | "dead" | "draining" | "offline"
    reason: str
    silent_s: float | None  # seconds since the last heartbeat; None: never


def agent_health(agent, now: datetime) -> AgentHealth:
    silent_s = (
        (now - agent.last_heartbeat).total_seconds() if agent.last_heartbeat else None
    )
    limit = agent_dead_after_s()
    if silent_s is None:
        return AgentHealth(False, "dead", "never sent a heartbeat", None)
    if silent_s > limit:
        return AgentHealth(
            False,
            "dead",
            f"missed heartbeats: last seen {_ago(silent_s)} ago "
            f"(dead after {limit} s of silence)",
            silent_s,
        )
    if agent.state == "offline":
        return AgentHealth(False, "offline", "marked offline", silent_s)
    if agent.state == "draining":
        return AgentHealth(True, "draining", "takes no new jobs", silent_s)
    return AgentHealth(True, "alive", f"heartbeat {_ago(silent_s)} ago", silent_s)


@dataclass(frozen=True)
class JobHealth:
    stuck: bool
    retried: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "stuck" if self.stuck else "retried" if self.retried else ""


def job_health(job, now: datetime) -> JobHealth:
    reasons = []
    stuck = False
    if job.state == "running":
        if job.lease_expires is not None and job.lease_expires <= now:
            stuck = True
            since = (now - job.lease_expires).total_seconds()
            reasons.append(
                f"lease expired {_ago(since)} ago at "
                f"{job.lease_expires:%Y-%m-%d %H:%M:%S} UTC: its worker stopped "
                "renewing it"
            )
        if job.agent is not None:
            health = agent_health(job.agent, now)
            if not health.alive:
                stuck = True
                reasons.append(f"agent {job.agent.name} {health.reason}")
    retried = job.attempts > 1
    if retried:
        reasons.append(
            f"attempt {job.attempts}: {job.attempts - 1} earlier attempt(s) did not "
            "finish"
        )
    return JobHealth(stuck=stuck, retried=retried, reasons=reasons)


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h"
