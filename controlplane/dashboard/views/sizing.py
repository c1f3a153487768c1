"""/sizing/: a release manager pastes a model's config.json, picks the devices and
formats, and reads the memory report (gpuagent.sizing) without the weights on the
machine. Nothing is stored: the post only computes."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from controlplane.dashboard.forms import SizingForm
from gpuagent.sizing import TENSOR_CLASSES, SizingError, SizingReport, size_deployment


def _billions(n: int) -> str:
    return f"{n / 1e9:,.2f} B"


def report_tables(report: SizingReport) -> dict:
    """The report's rows as the page shows them."""
    knobs = report.knobs
    chosen = next(w for w in report.weights if w.format == knobs.weights)
    return {
        "params": [
            (c, _billions(report.params_by_class[c]), _billions(a))
            for c in TENSOR_CLASSES
            if (a := report.active_params_by_class[c]) or report.params_by_class[c]
        ],
        "total": _billions(report.total_params),
        "active": _billions(report.active_params),
        "active_no_embeddings": _billions(report.active_params_no_embeddings),
        "mtp": _billions(report.mtp_params) if report.mtp_params else "",
        "weights": [
            (w, w.per_device_bytes(knobs.devices, knobs.parallelism), w is chosen)
            for w in report.weights
            + ([report.published_weights] if report.published_weights else [])
        ],
        "kv": [
            (
                k,
                k.expanded_bytes_per_token
                and f"{k.expanded_bytes_per_token / k.bytes_per_token:.1f}x",
                k.kv_dtype == report.knobs.kv_cache_dtype,
                report.sessions_by_kv_dtype[k.kv_dtype],
            )
            for k in report.kv
        ],
        "plans": [("This deployment", report.deployment)]
        + [("Devices needed", report.devices_needed)],
    }


@login_required
def sizing(request):
    form = SizingForm(request.POST or None)
    report, status = None, 200
    if request.method == "POST":
        status = 400
        if form.is_valid():
            try:
                report = size_deployment(form.cleaned_data["config"], form.knobs())
            except SizingError as exc:
                form.add_error(None, str(exc))
            else:
                status = 200
    ctx = {"form": form, "report": report}
    if report is not None:
        ctx["tables"] = report_tables(report)
    return render(request, "dashboard/sizing.html", ctx, status=status)
