"""Cost for finance: the load tests engineering sees on each release page, one row
per release and workload, priced with each environment's cost model at the SLO of
its gate policy, with the capacity the target traffic needs against the live
release. The page and its CSV are the same rows."""

import csv
from dataclasses import replace
from decimal import Decimal

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Prefetch
from django.http import HttpResponse
from django.shortcuts import render

from controlplane.costs.report import (
    EnvironmentCosts,
    ReleaseCosts,
    environment_costs,
    release_costs,
)
from controlplane.dashboard import charts
from controlplane.dashboard.forms import filter_releases, typed_targets
from controlplane.releases import evidence
from controlplane.releases.models import Job

MAX_RELEASES = 100
# Money first: on a phone the first columns are what shows without scrolling.
COLUMNS = (
    ("release", "release"),
    ("workload", "workload"),
    ("currency", "currency"),
    ("cost_per_1m_output_tokens", "per 1M output tokens"),
    ("cost_per_1m_input_tokens", "per 1M input tokens"),
    ("cost_per_request", "per request"),
    ("requests_per_device_hour", "requests per device-hour"),
    ("requests_per_s_at_slo", "req/s at SLO (one replica)"),
    ("output_tokens_per_s_at_slo", "output tokens/s at SLO"),
    ("max_concurrency_at_slo", "max concurrency at SLO"),
    ("prefix_cache_hit_rate_at_slo", "prefix-cache hit rate at SLO"),
    ("target_requests_per_s", "target req/s"),
    ("devices_needed", "devices needed"),
    ("live_devices_needed", "live devices needed"),
    ("device_difference", "Δ devices vs live"),
    ("monthly_cost", "per month"),
    ("monthly_cost_difference", "Δ per month vs live"),
    ("live_release", "live release"),
    ("context_tokens", "context tokens"),
    ("max_sessions_at_context", "sessions at context"),
    ("devices_per_replica", "devices per replica"),
    ("device_hour_cost", "per device-hour"),
    ("price_note", "price note"),
    ("weights", "weights"),
    ("kv_cache_dtype", "KV dtype"),
    ("state", "state"),
    ("environment", "target environment"),
)
# A spreadsheet runs a cell that starts with one of these as a formula.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _workload_rows(costs: ReleaseCosts) -> list[dict]:
    release, env = costs.release, costs.env
    plan_rows = {row.workload: row for row in costs.plan.rows} if costs.plan else {}
    rows = []
    for name, economics in costs.workloads.items():
        unit = economics.costs
        run = economics.operating_point
        plan = plan_rows.get(name)
        live_side = plan.live if plan else None
        rows.append(
            {
                "release": str(release),
                "release_id": release.pk,
                "workload": name,
                "currency": costs.currency,
                "cost_per_1m_output_tokens": unit and unit.cost_per_1m_output_tokens,
                "cost_per_1m_input_tokens": unit and unit.cost_per_1m_input_tokens,
                "cost_per_request": unit and unit.cost_per_request,
                "requests_per_device_hour": unit and unit.requests_per_device_hour,
                "requests_per_s_at_slo": unit and unit.requests_per_s,
                "output_tokens_per_s_at_slo": run and run.output_tokens_per_s,
                "max_concurrency_at_slo": economics.knee,
                "prefix_cache_hit_rate_at_slo": run and run.prefix_cache_hit_rate,
                "target_requests_per_s": plan and plan.target_requests_per_s,
                "devices_needed": plan and plan.candidate.devices,
                "live_devices_needed": live_side and live_side.devices,
                "device_difference": plan and plan.device_difference,
                "monthly_cost": plan and plan.candidate.monthly_cost,
                "monthly_cost_difference": plan and plan.monthly_difference,
                "live_release": str(costs.live_release) if costs.live_release else "",
                "context_tokens": economics.workload.context_tokens,
                "max_sessions_at_context": economics.workload.max_sessions_at_context,
                "devices_per_replica": unit and unit.devices_per_replica,
                "device_hour_cost": env.pricing.device_hour_cost,
                "price_note": env.cost_model.note,
                "weights": release.recipe.get("weights", ""),
                "kv_cache_dtype": costs.load.kv_cache_dtype,
                "state": release.state,
                "environment": str(release.target_environment),
            }
        )
    return rows


def release_costs_of(releases, targets=None) -> tuple[list[ReleaseCosts], list[str]]:
    """(ReleaseCosts of each of `releases` that has a load test, problems): one
    query for the reports, one per environment for its policy, cost model and
    live release; each release is compared with its environment's live one
    (not with itself)."""
    releases = list(
        releases[:MAX_RELEASES].prefetch_related(
            Prefetch("jobs", queryset=Job.objects.order_by("created", "id"))
        )
    )
    try:
        reports = evidence.load_reports(releases)
        problems = []
    except evidence.EvidenceUnreadable as exc:
        reports, problems = {}, [exc.message]
    environments: dict[int, EnvironmentCosts] = {}
    found = []
    for release in releases:
        report = reports.get(release.pk)
        if report is None:
            continue
        env = environments.get(release.target_environment_id)
        if env is None:
            env = environment_costs(release.target_environment)
            environments[release.target_environment_id] = env
            problems += env.problems
        if env.live_release is not None and env.live_release.pk == release.pk:
            env = replace(env, live_release=None, live_load=None)
        found.append(release_costs(release, targets=targets, env=env, load=report))
    return found, problems


def cost_rows(
    releases, targets=None
) -> tuple[list[dict], list[ReleaseCosts], list[str]]:
    """(rows, each release's costs, problems) for `releases` that have a load test."""
    found, problems = release_costs_of(releases, targets)
    return [row for costs in found for row in _workload_rows(costs)], found, problems


def _shown(value) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, Decimal):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if value < 1e4 else f"{value:,.0f}"
    return str(value)


def _warnings(found: list[ReleaseCosts]) -> list[str]:
    return list(dict.fromkeys(w for costs in found for w in costs.env.warnings))


@login_required
def cost(request):
    form, releases, status = filter_releases(request)
    targets, targets_error = typed_targets(request)
    rows, found, problems = cost_rows(releases, targets)
    for problem in problems:
        messages.error(request, problem)
    figure = charts.cost_figure(
        [(str(costs.release), costs.workloads, costs.currency) for costs in found]
    )
    ctx = {
        "form": form,
        "rows": rows,
        "table": [(row, [_shown(row[key]) for key, _ in COLUMNS]) for row in rows],
        "columns": COLUMNS,
        "releases": found,
        "warnings": _warnings(found),
        "targets_text": request.GET.get("targets", ""),
        "targets_error": targets_error,
        "query": request.GET.urlencode(),
        "charts": {"cost": figure} if figure else {},
    }
    if targets_error:
        status = 400
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
    targets, targets_error = typed_targets(request)
    if targets_error:
        return HttpResponse(targets_error, status=400, content_type="text/plain")
    rows, _, problems = cost_rows(releases, targets)
    if problems:
        return HttpResponse("\n".join(problems), status=409, content_type="text/plain")
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="releasegate-cost.csv"'
    writer = csv.writer(response)
    writer.writerow([key for key, _ in COLUMNS])
    for row in rows:
        writer.writerow([_cell(row[key]) for key, _ in COLUMNS])
    return response
