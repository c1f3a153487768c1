"""Cost for finance: the load-test reports engineering sees on each release page, one
row per release and workload, as money. The page and its CSV are the same rows."""

import csv

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.shortcuts import render

from controlplane.dashboard import charts
from controlplane.dashboard.forms import filter_releases
from controlplane.releases import evidence

MAX_RELEASES = 100
# Money first: on a phone the first columns are what shows without scrolling.
COLUMNS = (
    ("release", "release"),
    ("workload", "workload"),
    ("cost_per_1m_output_tokens", "USD per 1M output tokens"),
    ("cost_per_request", "USD per request"),
    ("requests_per_gpu_hour", "requests per GPU-hour"),
    ("output_tokens_per_s_at_slo", "output tokens/s at SLO"),
    ("max_concurrency_at_slo", "max concurrency at SLO"),
    ("context_tokens", "context tokens"),
    ("max_sessions_at_context", "sessions at context"),
    ("gpu_count", "GPUs"),
    ("gpu_hourly_usd", "USD per GPU-hour"),
    ("weights", "weights"),
    ("kv_cache_dtype", "KV dtype"),
    ("state", "state"),
    ("environment", "target environment"),
)
# A spreadsheet runs a cell that starts with one of these as a formula.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def cost_rows(releases) -> tuple[list[dict], list[tuple], list[str]]:
    """(rows, chart columns, problems) for `releases` that have a load test."""
    releases = list(releases[:MAX_RELEASES])
    try:
        reports = evidence.load_reports(releases)
        problems = []
    except evidence.EvidenceUnreadable as exc:
        reports, problems = {}, [exc.message]
    rows, columns = [], []
    for release in releases:
        report = reports.get(release.pk)
        if report is None:
            continue
        columns.append((str(release), report))
        for workload in report.workloads:
            rows.append(
                {
                    "release": str(release),
                    "release_id": release.pk,
                    "state": release.state,
                    "environment": str(release.target_environment),
                    "weights": release.recipe.get("weights", ""),
                    "kv_cache_dtype": report.kv_cache_dtype,
                    "workload": workload.profile,
                    "context_tokens": workload.context_tokens,
                    "gpu_count": report.gpu_count,
                    "gpu_hourly_usd": report.gpu_hourly_usd,
                    "max_concurrency_at_slo": workload.max_concurrency_at_slo,
                    "output_tokens_per_s_at_slo": workload.output_tokens_per_s_at_slo,
                    "cost_per_1m_output_tokens": workload.cost_per_1m_output_tokens,
                    "cost_per_request": workload.cost_per_request,
                    "requests_per_gpu_hour": workload.requests_per_gpu_hour,
                    "max_sessions_at_context": workload.max_sessions_at_context,
                }
            )
    return rows, columns, problems


@login_required
def cost(request):
    form, releases, status = filter_releases(request)
    rows, columns, problems = cost_rows(releases)
    for problem in problems:
        messages.error(request, problem)
    ctx = {
        "form": form,
        "rows": rows,
        "columns": COLUMNS,
        "query": request.GET.urlencode(),
        "charts": {"cost": charts.cost_figure(columns)} if columns else {},
    }
    return render(request, "dashboard/cost.html", ctx, status=status)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return str(value)


@login_required
def cost_csv(request):
    form, releases, status = filter_releases(request)
    if status != 200:
        return HttpResponse(
            form.errors.as_text(), status=400, content_type="text/plain"
        )
    rows, _, problems = cost_rows(releases)
    if problems:
        return HttpResponse("\n".join(problems), status=409, content_type="text/plain")
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="releasegate-cost.csv"'
    writer = csv.writer(response)
    writer.writerow([key for key, _ in COLUMNS])
    for row in rows:
        writer.writerow([_cell(row[key]) for key, _ in COLUMNS])
    return response
