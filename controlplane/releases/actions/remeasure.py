"""Re-measuring a release's evidence without reject and reopen: its evaluate and/or
load_test job again, then its gate.

Allowed for a release the gate has judged and no one has approved: gated (the
gate was inconclusive: evidence missing or unreadable as evidence), awaiting
approval, or failed by the gate itself (the newest job of the release is a gate
job whose outcome was fail). The release goes to (or stays in) gated; the new jobs
are created here and sent by the pipeline (`pipeline.remeasure`), which holds the
gate until they have answered (`pipeline.remeasure_pending`). Anything else is a
Conflict naming the state. One audited event holds the state before and the
stages asked for."""

from collections.abc import Sequence

from django.db import transaction

from controlplane.accounts.actions import check_actor_in_team
from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import Conflict, ValidationFailed
from controlplane.releases.actions.jobs import do_dispatch_job
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Job, Release
from gpuagent.protocol import LOAD_TEST_JOB_KIND, QUALITY_JOB_KIND

REMEASURE_KINDS = (QUALITY_JOB_KIND, LOAD_TEST_JOB_KIND)
REMEASURABLE_STATES = ("gated", "awaiting_approval", "failed")
OPEN_STATES = ("queued", "running")


def check_remeasure_stages(stages: Sequence[str]) -> list[str]:
    """The stages, validated: some of REMEASURE_KINDS, each once."""
    stages = list(stages)
    unknown = [s for s in stages if s not in REMEASURE_KINDS]
    if not stages or unknown:
        raise ValidationFailed(
            f"stages must name some of {', '.join(REMEASURE_KINDS)}"
            + (f"; unknown: {', '.join(map(str, unknown))}" if unknown else ""),
            field="stages",
        )
    if len(set(stages)) != len(stages):
        raise ValidationFailed("stages must name each stage once", field="stages")
    return [k for k in REMEASURE_KINDS if k in stages]


def failed_at_the_gate(release: Release) -> bool:
    """The release failed because its gate said fail (not a job or a check)."""
    newest = release.jobs.order_by("-id").first()
    return (
        release.state == "failed"
        and newest is not None
        and newest.kind == "gate"
        and (newest.result or {}).get("outcome") == "fail"
    )


def remeasurable_state(release: Release) -> bool:
    """Whether the release's state admits a re-measure (a running one aside)."""
    return release.state in REMEASURABLE_STATES and (
        release.state != "failed" or failed_at_the_gate(release)
    )


def check_remeasurable(release: Release) -> None:
    """Conflict unless the release may be re-measured now."""
    if not remeasurable_state(release):
        raise Conflict(
            f"release {release} is {release.state}"
            + (" (not by its gate)" if release.state == "failed" else "")
            + "; only a gated release, one awaiting approval or one its gate "
            "failed can be re-measured"
        )
    running = release.jobs.filter(kind__in=REMEASURE_KINDS, state__in=OPEN_STATES)
    if running.exists():
        kinds = sorted(set(running.values_list("kind", flat=True)))
        raise Conflict(
            f"release {release} is being measured already ({', '.join(kinds)}); "
            "wait for its gate"
        )


def check_remeasure_release(release: Release, actor: Actor) -> None:
    """Raise as do_request_remeasure would, before it is asked to (the dashboard's
    form and confirmation step): not allowed to (Forbidden: whoever may promote in
    the release's team), then not re-measurable now (Conflict)."""
    check_actor_in_team(actor, release.team, scope="promote")
    check_remeasurable(release)


def do_request_remeasure(
    release: Release, actor: Actor, *, stages: Sequence[str]
) -> list[Job]:
    """Move the release to gated and create the jobs of `stages` (the caller sends
    them: pipeline.remeasure); returns the jobs."""
    check_actor_in_team(actor, release.team, scope="promote")
    kinds = check_remeasure_stages(stages)
    with transaction.atomic():
        release.refresh_from_db(from_queryset=Release.objects.select_for_update())
        check_remeasurable(release)
        before = {"state": release.state, "failure_reason": release.failure_reason}
        reason = "re-measure: " + ", ".join(kinds)
        if release.state != "gated":
            do_transition_release(release, "gated", actor=actor, reason=reason)
        jobs = [do_dispatch_job(release, kind) for kind in kinds]
        do_record_event(
            actor,
            "release.remeasure_requested",
            release,
            before=before,
            after={"state": release.state, "stages": kinds},
            team=release.team,
        )
    return jobs
