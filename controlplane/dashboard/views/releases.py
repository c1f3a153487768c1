from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Prefetch, Q
from django.shortcuts import render
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.costs.report import format_targets
from controlplane.dashboard import access, charts, timeline
from controlplane.dashboard.forms import filter_releases, typed_targets
from controlplane.dashboard.release_page import release_evidence
from controlplane.dashboard.views.remeasure import STAGE_LABELS
from controlplane.releases import evidence, timings
from controlplane.releases.models import AFTER_DEPLOY_JOB_KINDS, Job, Release

RELEASES_PER_PAGE = 25
REVERIFICATIONS_PER_PAGE = 25
RUNNING_PIPELINES_SHOWN = 50
# A pipeline is running while the release is in one of these states, except a gated
# release whose gate stage has finished: it waits for a person or for new evidence
# (an inconclusive gate pauses there), as one awaiting approval does.
ACTIVE_STATES = (
    "verifying",
    "compressing",
    "evaluating",
    "gated",
    "approved",
    "deploying",
)


def _running_pipelines(user) -> list[dict]:
    now = timezone.now()
    releases = access.releases(user).filter(state__in=ACTIVE_STATES)
    jobs = Prefetch("jobs", queryset=Job.objects.select_related("agent"))
    rows = []
    for release in releases.prefetch_related(jobs, "gate_results"):
        jobs_of_release = list(release.jobs.all())
        if release.state == "gated" and timeline.paused_at_gate(jobs_of_release):
            continue
        stages = timeline.latest_per_kind(
            jobs_of_release, now, list(release.gate_results.all())
        )
        rows.append({"release": release, "stages": stages})
        if len(rows) == RUNNING_PIPELINES_SHOWN:
            break
    return rows


@login_required
def release_list(request):
    form, releases, status = filter_releases(request)
    page = Paginator(releases, RELEASES_PER_PAGE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    ctx = {
        "form": form,
        "page": page,
        "releases": page.object_list,
        "filter_query": query.urlencode(),
        "pipelines": _running_pipelines(request.user),
    }
    return render(request, "dashboard/release_list.html", ctx, status=status)


@login_required
def running_pipelines(request):
    ctx = {"pipelines": _running_pipelines(request.user)}
    return render(request, "dashboard/_pipelines.html", ctx)


def _status_context(release: Release) -> dict:
    now = timezone.now()
    pipeline_jobs = release.jobs.exclude(kind__in=AFTER_DEPLOY_JOB_KINDS)
    jobs = list(pipeline_jobs.select_related("agent"))
    gate_results = list(release.gate_results.all())
    reverified = evidence.reverifications(release)
    return {
        "release": release,
        "stages": timeline.stages(jobs, now, gate_results, reverified),
        "overhead": timings.overhead(jobs, now),
    }


def _audit_trail(release: Release):
    job_ids = [str(pk) for pk in release.jobs.values_list("pk", flat=True)]
    deployment_ids = [
        str(pk) for pk in release.deployments.values_list("pk", flat=True)
    ]
    return AuditEvent.objects.filter(
        Q(object_type="release", object_id=str(release.pk))
        | Q(object_type="job", object_id__in=job_ids)
        | Q(object_type="deployment", object_id__in=deployment_ids)
    ).order_by("created", "id")


@login_required
def release_detail(request, release_id: int):
    release = access.release_or_404(request.user, release_id)
    status = _status_context(release)
    targets, targets_error = typed_targets(request)
    page = release_evidence(release, targets=targets)
    timeline_figure = charts.timeline_figure(status["stages"])
    if timeline_figure:
        page.charts["timeline"] = timeline_figure
    ctx = {
        **status,
        "evidence": page,
        "gate_results": release.gate_results.all(),
        "artifacts": release.artifacts.all(),
        "approvals": release.approvals.select_related("user", "token"),
        "deployments": release.deployments.select_related("environment", "agent"),
        "history": _audit_trail(release),
        "decision_refusal": access.decision_refusal(release, request.user),
        "reopen_refusal": access.reopen_refusal(release, request.user),
        "remeasure_refusal": access.remeasure_refusal(release, request.user),
        "remeasure_stages": STAGE_LABELS,
        "targets_text": request.GET.get("targets", format_targets(page.costs.targets)),
        "targets_error": targets_error,
    }
    return render(
        request,
        "dashboard/release_detail.html",
        ctx,
        status=400 if targets_error else 200,
    )


@login_required
def release_status(request, release_id: int):
    release = access.release_or_404(request.user, release_id)
    return render(request, "dashboard/_release_status.html", _status_context(release))


@login_required
def release_reverifications(request, release_id: int):
    release = access.release_or_404(request.user, release_id)
    jobs = release.jobs.filter(kind__in=AFTER_DEPLOY_JOB_KINDS).select_related("agent")
    page = Paginator(jobs.order_by("-created", "-id"), REVERIFICATIONS_PER_PAGE)
    ctx = {"release": release, "page": page.get_page(request.GET.get("page"))}
    return render(request, "dashboard/reverifications.html", ctx)
