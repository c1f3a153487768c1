"""What the checks cost, one definition for the API and the dashboard.

Time to deploy is the machine time of the pipeline: the union of every job's interval
on the way to the first successful deploy (or to now, while it runs). The wait for an
approver is not in it: it measures people, not checks. The integrity share is the
union of the integrity jobs' intervals over that time (inspection, signing, verifying
on another agent); the test share likewise for quality regression and load tests,
which run in parallel, so their union, not their sum, is what they add.
Verify-on-load happens inside the deploy job and is counted there. A job that did no
work (its result says `{"skipped": why}`) took time but checked nothing, so it counts
in the time to deploy and in no check's share.

`stage_timings(release)` reports every job's queued, started and finished times
with those numbers (seconds and percent), for the release's API detail.
"""

from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from controlplane.releases.models import (
    AFTER_DEPLOY_JOB_KINDS,
    INTEGRITY_JOB_KINDS,
    Job,
)
from gpuagent.protocol import LOAD_TEST_JOB_KIND, QUALITY_JOB_KIND

TEST_KINDS = (QUALITY_JOB_KIND, LOAD_TEST_JOB_KIND)


def skipped_reason(job) -> str | None:
    """Why `job` did no work, or None when it did (or has not finished)."""
    result = job.result if isinstance(job.result, dict) else {}
    if job.state != "succeeded" or "skipped" not in result:
        return None
    return str(result["skipped"] or "no reason given")


@dataclass(frozen=True)
class Overhead:
    time_to_deploy_s: float
    integrity_s: float
    tests_s: float
    deployed: bool

    @property
    def integrity_share(self) -> float | None:
        return (
            self.integrity_s / self.time_to_deploy_s if self.time_to_deploy_s else None
        )

    @property
    def tests_share(self) -> float | None:
        return self.tests_s / self.time_to_deploy_s if self.time_to_deploy_s else None


def overhead(jobs, now: datetime) -> Overhead:
    jobs = [j for j in jobs if j.started and j.kind not in AFTER_DEPLOY_JOB_KINDS]
    deploys = [
        j.finished for j in jobs if j.kind == "deploy" and j.state == "succeeded"
    ]
    end = min(deploys) if deploys else now

    def spans(kinds=None) -> list[tuple[datetime, datetime]]:
        # A check that skipped its work added no checking, only time to deploy.
        return [
            (j.started, min(j.finished or now, end))
            for j in jobs
            if j.started < end
            and (kinds is None or (j.kind in kinds and skipped_reason(j) is None))
        ]

    return Overhead(
        time_to_deploy_s=_union_s(spans()),
        integrity_s=_union_s(spans(INTEGRITY_JOB_KINDS)),
        tests_s=_union_s(spans(TEST_KINDS)),
        deployed=bool(deploys),
    )


def _union_s(spans: list[tuple[datetime, datetime]]) -> float:
    """Seconds covered by at least one of `spans` (overlaps counted once)."""
    total = 0.0
    current_start = current_end = None
    for start, end in sorted(spans):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += (current_end - current_start).total_seconds()
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += (current_end - current_start).total_seconds()
    return total


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _pct(part: float, whole: float) -> float | None:
    return round(100 * part / whole, 1) if whole else None


def stage_timings(release) -> dict:
    """{"stages": [every pipeline job, oldest first; not the re-verifications of
    the live copy], "time_to_deploy_s", "deployed",
    "integrity_s", "integrity_pct", "quality_load_s", "quality_load_pct"}."""
    jobs = list(
        release.jobs.exclude(kind__in=AFTER_DEPLOY_JOB_KINDS)
        .select_related("agent")
        .order_by("created", "id")
    )
    spent = overhead(jobs, timezone.now())
    return {
        "stages": [
            {
                "kind": job.kind,
                "state": job.state,
                "agent": job.agent.name if job.agent else None,
                "attempts": job.attempts,
                "queued": _iso(job.created),
                "started": _iso(job.started),
                "finished": _iso(job.finished),
                "duration_s": job.duration_s,
            }
            for job in jobs
        ],
        "time_to_deploy_s": round(spent.time_to_deploy_s, 3),
        "deployed": spent.deployed,
        "integrity_s": round(spent.integrity_s, 3),
        "integrity_pct": _pct(spent.integrity_s, spent.time_to_deploy_s),
        "quality_load_s": round(spent.tests_s, 3),
        "quality_load_pct": _pct(spent.tests_s, spent.time_to_deploy_s),
    }


def rollback_readiness(target) -> dict:
    """How a rollback to the Deployment `target` would go: {"warm": whether its
    server still runs (traffic goes back after a re-hash and a health check) or
    it is cold (kept verified on disk, restarted), "estimate_s": about how long
    (None: nothing measured), "basis": what the estimate is}. Cold: the time its
    release's last deploy that started a server took, else the environment's last
    measured one; warm: its copy's last re-hash (re-verification or verify)."""
    release = target.release
    done = Job.objects.filter(state="succeeded", finished__isnull=False)
    if target.warm:
        hashed = (
            done.filter(release=release, kind__in=("reverify", "verify"))
            .order_by("-finished", "-id")
            .first()
        )
        measured = f"its last {hashed.kind} job" if hashed else "nothing measured"
        return {
            "warm": True,
            "estimate_s": _rounded(hashed.duration_s) if hashed else None,
            "basis": "warm: its server still runs; a re-hash of its copy and a "
            f"health check, no restart (estimate: {measured})",
        }
    # A deploy that went back to a warm server started nothing: not a start time.
    starts = done.filter(kind="deploy").exclude(
        deployment__placement_note__startswith="warm"
    )
    own = starts.filter(release=release).order_by("-finished", "-id").first()
    last = (
        own
        or starts.filter(deployment__environment_id=target.environment_id)
        .order_by("-finished", "-id")
        .first()
    )
    if last is None:
        measured = "no deploy measured yet"
    elif own is not None:
        measured = "its own last deploy"
    else:
        measured = f"the last deploy measured here, {last.release}"
    return {
        "warm": False,
        "estimate_s": _rounded(last.duration_s) if last else None,
        "basis": "cold: its server was stopped; restarted from its verified copy "
        f"on disk (estimate: {measured})",
    }


def _rounded(seconds: float | None) -> float | None:
    return round(seconds, 1) if seconds is not None else None
