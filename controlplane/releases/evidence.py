"""The one place that reads a release's recorded evidence out of its jobs.

Agents return their reports as job results (schemas in `gpuagent/protocol.py`, a fixed
contract): the evaluate job a QualityReport, the load-test job a LoadTestReport. The
dashboard (and anything else that shows or judges evidence) reads them through these
functions only, so where the pipeline keeps a report is known here and nowhere else.

Today a report is the `result` JSON of the newest succeeded job of its kind; one
that says it skipped the work (`{"skipped": why}`, what stages without agent work
record) measured nothing, so there is no report. A result that does not validate
against its schema is not evidence: it raises EvidenceUnreadable naming the job and
the first problem, never a silent None, so a broken report can't pass for "no
evidence yet" or for a good one.
"""

from dataclasses import dataclass, field
from datetime import datetime

from pydantic import BaseModel, ValidationError

from controlplane.releases.gates import LiveBaseline
from controlplane.releases.models import AFTER_DEPLOY_JOB_KINDS, Job, Release
from gpuagent.protocol import (
    LOAD_TEST_JOB_KIND,
    QUALITY_JOB_KIND,
    CompressJobResult,
    LoadTestReport,
    QualityReport,
)

# Jobs whose success means the release's bytes were hashed and matched: the check on
# another agent after signing, the periodic re-hash of a live copy, verify-on-load.
VERIFYING_JOB_KINDS = ("verify", "reverify", "deploy")
SIGNING_JOB_KINDS = ("sign", "verify")
UNTRUSTED_RELEASE_STATES = ("failed_verification", "quarantined")
# The jobs whose outcomes the integrity gate reads.
INTEGRITY_JOB_KINDS = ("verify_source", "sign", "verify")
OPEN_JOB_STATES = ("queued", "running")


class EvidenceUnreadable(Exception):
    """A recorded result that does not match its report schema."""

    def __init__(self, job: Job, problem: str):
        self.job = job
        self.message = (
            f"{job.kind} job {job.pk} recorded an unreadable report: {problem}"
        )
        super().__init__(self.message)


def latest_succeeded(release: Release, kind: str) -> Job | None:
    """The release's newest succeeded job of `kind`, or None."""
    return (
        release.jobs.filter(kind=kind, state="succeeded")
        .order_by("-finished", "-id")
        .first()
    )


def _validated(job: Job, schema: type[BaseModel]):
    try:
        return schema.model_validate(job.result)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise EvidenceUnreadable(job, f"{where}: {first['msg']}") from exc


def _measured(job: Job | None) -> bool:
    return job is not None and "skipped" not in job.result


def _report(release: Release, kind: str, schema: type[BaseModel]):
    job = latest_succeeded(release, kind)
    return _validated(job, schema) if _measured(job) else None


def quality_report(release: Release) -> QualityReport | None:
    """The newest quality regression of `release`, or None when none succeeded."""
    return _report(release, QUALITY_JOB_KIND, QualityReport)


def load_report(release: Release) -> LoadTestReport | None:
    """The newest load test of `release`, or None when none succeeded."""
    return _report(release, LOAD_TEST_JOB_KIND, LoadTestReport)


def compress_report(release: Release) -> CompressJobResult | None:
    """What the newest compress job of `release` made and reported (sizes; for
    MoE models total vs active parameters and the experts GPTQ rounded to nearest),
    or None when none succeeded."""
    return _report(release, "compress", CompressJobResult)


def load_reports(releases) -> dict[int, LoadTestReport]:
    """{release id: newest load test} for many releases in one query; releases
    without one are absent. Raises EvidenceUnreadable like `load_report`."""
    jobs = Job.objects.filter(
        release__in=releases, kind=LOAD_TEST_JOB_KIND, state="succeeded"
    ).order_by("release_id", "-finished", "-id")
    reports: dict[int, LoadTestReport] = {}
    seen: set[int] = set()
    for job in jobs:
        if job.release_id in seen:
            continue
        seen.add(job.release_id)
        if _measured(job):
            reports[job.release_id] = _validated(job, LoadTestReport)
    return reports


def integrity_ok(release: Release) -> bool | None:
    """The newest source inspection, signing and verification all succeeded (and a
    manifest and signature are recorded): True; one failed: False; one never
    ran: None."""
    outcomes = []
    for kind in INTEGRITY_JOB_KINDS:
        job = release.jobs.filter(kind=kind).exclude(state__in=OPEN_JOB_STATES)
        latest = job.order_by("-finished", "-id").first()
        outcomes.append(None if latest is None else latest.state == "succeeded")
    if False in outcomes:
        return False
    if None in outcomes or not (release.manifest_digest and release.signature):
        return None
    return True


def live_release_for(release: Release) -> Release | None:
    """The release live (or failed verification) in `release`'s target environment,
    unless that is `release` itself."""
    deployment = release.target_environment.live_deployment
    if deployment is None or deployment.release_id == release.pk:
        return None
    return deployment.release


def live_baseline(release: Release) -> LiveBaseline | None:
    """What the gates compare `release` with: the live release of its target
    environment and its load test (None: nothing else is live there). A live
    report that doesn't validate is no baseline, and the baseline says why."""
    live = live_release_for(release)
    if live is None:
        return None
    try:
        return LiveBaseline(str(live), load_report(live))
    except EvidenceUnreadable as exc:
        return LiveBaseline(str(live), None, problem=exc.message)


@dataclass(frozen=True)
class Reverifications:
    """The periodic re-verifications of a release's live copy in one line: how
    many ran, and the newest (finished or not), None before the first."""

    count: int
    newest: Job | None = None

    def to_dict(self) -> dict:
        newest = self.newest.to_dict() if self.newest else None
        return {"count": self.count, "newest": newest}


def reverifications(release: Release) -> Reverifications:
    """How often the release's live copy was re-verified, and the newest check;
    the whole history is the release's jobs of AFTER_DEPLOY_JOB_KINDS."""
    jobs = Job.objects.filter(release=release, kind__in=AFTER_DEPLOY_JOB_KINDS)
    newest = jobs.select_related("agent").order_by("-created", "-id").first()
    return Reverifications(count=jobs.count() if newest else 0, newest=newest)


@dataclass(frozen=True)
class Verification:
    """The newest check of a release's bytes: which job, when, and what it found.
    `ok` is None when the bytes were never checked after signing."""

    ok: bool | None
    kind: str = ""
    checked: datetime | None = None
    detail: str = ""
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Integrity:
    signed: bool
    signer: str
    verification: Verification


def verification(release: Release) -> Verification:
    """Whether `release`'s bytes matched the last time a job hashed them. A job that
    says it skipped the work is no check; a release quarantined or failed in
    verification is not verified whatever an older job said."""
    jobs = release.jobs.filter(
        kind__in=VERIFYING_JOB_KINDS, state__in=("succeeded", "failed")
    ).order_by("-finished", "-id")
    latest = next((job for job in jobs if _measured(job)), None)
    if release.state in UNTRUSTED_RELEASE_STATES:
        return Verification(
            ok=False,
            kind=latest.kind if latest else "",
            checked=latest.finished if latest else None,
            detail=release.failure_reason or f"release is {release.state}",
            **_file_lists(latest),
        )
    if latest is None:
        return Verification(ok=None, detail="never verified after signing")
    ok = latest.state == "succeeded"
    return Verification(
        ok=ok,
        kind=latest.kind,
        checked=latest.finished,
        detail="" if ok else latest.error,
        **_file_lists(latest),
    )


def _file_lists(job: Job | None) -> dict[str, list[str]]:
    result = job.result if job else {}
    return {key: list(result.get(key) or []) for key in ("missing", "extra", "changed")}


def integrity(release: Release) -> Integrity:
    """Signature and verification status of `release`'s artifacts. The signer is
    what the signing (or verifying) agent reported, empty when unknown."""
    signer = ""
    for job in release.jobs.filter(
        kind__in=SIGNING_JOB_KINDS, state="succeeded"
    ).order_by("-finished", "-id"):
        signer = str(job.result.get("signer") or "")
        if signer:
            break
    return Integrity(
        signed=bool(release.signature),
        signer=signer,
        verification=verification(release),
    )
