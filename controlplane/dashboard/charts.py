"""Plotly figures (plain dicts: data + layout) from the evidence reports.

Each function takes reports from `controlplane.releases.evidence` and returns a figure
that static/dashboard/charts.js hands to Plotly.newPlot unchanged; a figure is None
when there is nothing to draw, and the page says what evidence is missing instead.
"""

from gpuagent.protocol import LoadRun, LoadTestReport, QualityReport, WorkloadReport

GIB = 2**30
PERCENTILES = ("p50", "p90", "p95", "p99")
# Colour-blind-safe (Okabe-Ito); the same series keeps its colour on every chart.
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00")


def _layout(title: str, x_title: str = "", y_title: str = "", **extra) -> dict:
    layout = {
        "title": {"text": title, "font": {"size": 15}, "x": 0, "xanchor": "left"},
        "margin": {"l": 56, "r": 12, "t": 40, "b": 40},
        "height": 340,
        "autosize": True,
        # Below the x-axis title, so neither covers the other at any width.
        "legend": {"orientation": "h", "y": -0.3, "yanchor": "top"},
        "xaxis": {"title": {"text": x_title}, "automargin": True},
        "yaxis": {
            "title": {"text": y_title},
            "automargin": True,
            "rangemode": "tozero",
        },
        "font": {"family": "system-ui, sans-serif", "size": 12},
    }
    layout.update(extra)
    return layout


def headline_run(workload: WorkloadReport) -> LoadRun | None:
    """The run at the highest load that met the SLO; else the highest load run."""
    if not workload.runs:
        return None
    meeting = [r for r in workload.runs if r.meets_slo and r.valid]
    return (meeting or workload.runs)[-1]


def memory_figure(columns: list[tuple[str, LoadTestReport | None]]) -> dict | None:
    """GPU memory of each release, split into weights and the KV cache it fills at
    maximum concurrency (its whole KV budget), in GiB."""
    present = [(label, report) for label, report in columns if report is not None]
    if not present:
        return None
    labels = [label for label, _ in present]

    def sessions(report: LoadTestReport) -> str:
        return "<br>".join(
            f"{w.profile}: {w.max_sessions_at_context} sessions of "
            f"{w.context_tokens} tokens"
            for w in report.workloads
        )

    data = [
        {
            "type": "bar",
            "name": "weights",
            "x": labels,
            "y": [r.weights_bytes / GIB for _, r in present],
            "marker": {"color": COLOURS[0]},
            "hovertemplate": "weights %{y:.2f} GiB<extra></extra>",
        },
        {
            "type": "bar",
            "name": "KV cache at max concurrency",
            "x": labels,
            "y": [r.kv_budget_bytes / GIB for _, r in present],
            "marker": {"color": COLOURS[1]},
            "text": [f"KV {r.kv_cache_dtype}" for _, r in present],
            "customdata": [sessions(r) for _, r in present],
            "hovertemplate": "KV %{y:.2f} GiB<br>%{customdata}<extra></extra>",
        },
    ]
    return {
        "data": data,
        "layout": _layout(
            "GPU memory: weights + KV cache", y_title="GiB", barmode="stack"
        ),
    }


def _run_x(run: LoadRun) -> float | None:
    return run.concurrency if run.concurrency is not None else run.request_rate


def throughput_figure(report: LoadTestReport | None) -> dict | None:
    if report is None or not report.workloads:
        return None
    data = []
    for position, workload in enumerate(report.workloads):
        runs = [r for r in workload.runs if _run_x(r) is not None]
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": workload.profile,
                "x": [_run_x(r) for r in runs],
                "y": [r.output_tokens_per_s for r in runs],
                "marker": {
                    "color": COLOURS[position % len(COLOURS)],
                    "symbol": ["circle" if r.meets_slo else "x" for r in runs],
                    "size": 8,
                },
                "line": {"color": COLOURS[position % len(COLOURS)]},
                "text": ["meets SLO" if r.meets_slo else "misses SLO" for r in runs],
                "hovertemplate": "%{x}: %{y:.0f} tok/s (%{text})<extra></extra>",
            }
        )
    open_loop = all(r.concurrency is None for w in report.workloads for r in w.runs)
    x_title = "request rate (req/s)" if open_loop else "concurrent requests"
    return {
        "data": data,
        "layout": _layout(
            "Throughput vs load (x: SLO missed)", x_title, "output tokens/s"
        ),
    }


def latency_figure(report: LoadTestReport | None, metric: str) -> dict | None:
    """Percentiles of `metric` ("ttft_ms" or "tpot_ms") per workload at its headline
    load, with the workload's p99 SLO."""
    if report is None or not report.workloads:
        return None
    name = metric.removesuffix("_ms").upper()
    rows = [(w, headline_run(w)) for w in report.workloads]
    rows = [(w, run) for w, run in rows if run is not None]
    if not rows:
        return None
    profiles = [w.profile for w, _ in rows]
    data = [
        {
            "type": "bar",
            "name": percentile,
            "x": profiles,
            "y": [getattr(getattr(run, metric), percentile) for _, run in rows],
            "marker": {"color": COLOURS[position]},
            "hovertemplate": f"{percentile} %{{y:.1f}} ms<extra></extra>",
        }
        for position, percentile in enumerate(PERCENTILES)
    ]
    slo_field = f"slo_{metric.removesuffix('_ms')}_p99_ms"
    data.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "SLO (p99)",
            "x": profiles,
            "y": [getattr(w, slo_field) for w, _ in rows],
            "marker": {"color": "#000", "symbol": "line-ew-open", "size": 28},
            "hovertemplate": "SLO p99 %{y:.0f} ms<extra></extra>",
        }
    )
    return {
        "data": data,
        "layout": _layout(
            f"{name} p50–p99 at the SLO load",
            y_title="ms",
            barmode="group",
        ),
    }


def _by_kv_dtype(
    columns: list[tuple[str, LoadTestReport | None]],
) -> dict[str, LoadTestReport]:
    dtypes: dict[str, LoadTestReport] = {}
    for _, report in columns:
        if report is not None:
            dtypes.setdefault(report.kv_cache_dtype, report)
    return dtypes


def kv_bytes_figure(columns: list[tuple[str, LoadTestReport | None]]) -> dict | None:
    dtypes = _by_kv_dtype(columns)
    if not dtypes:
        return None
    data = [
        {
            "type": "bar",
            "x": list(dtypes),
            "y": [r.kv_bytes_per_token / 1024 for r in dtypes.values()],
            "marker": {"color": COLOURS[1]},
            "hovertemplate": "%{x}: %{y:.1f} KiB per token<extra></extra>",
            "name": "KV bytes per token",
        }
    ]
    return {
        "data": data,
        "layout": _layout(
            "KV bytes per token, by KV dtype",
            "KV dtype",
            "KiB per token",
            showlegend=False,
        ),
    }


def kv_sessions_figure(columns: list[tuple[str, LoadTestReport | None]]) -> dict | None:
    dtypes = _by_kv_dtype(columns)
    if not dtypes:
        return None
    data = []
    for position, (dtype, report) in enumerate(dtypes.items()):
        points = sorted(
            (w.context_tokens, w.max_sessions_at_context, w.profile)
            for w in report.workloads
        )
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": f"KV {dtype}",
                "x": [p[0] for p in points],
                "y": [p[1] for p in points],
                "text": [p[2] for p in points],
                "marker": {"color": COLOURS[position % len(COLOURS)], "size": 8},
                "line": {"color": COLOURS[position % len(COLOURS)]},
                "hovertemplate": "%{text}: %{y} sessions of %{x} tokens<extra></extra>",
            }
        )
    return {
        "data": data,
        "layout": _layout(
            "Max sessions per context length",
            "context length (tokens)",
            "sessions the KV budget holds",
        ),
    }


def quality_kld_figure(report: QualityReport | None) -> dict | None:
    if report is None or not report.slices:
        return None
    names = [s.name for s in report.slices]

    def error_bars(s) -> tuple[float, float]:
        if s.mean_kld_ci95 is None:
            return 0.0, 0.0
        return s.mean_kld_ci95.high - s.mean_kld, s.mean_kld - s.mean_kld_ci95.low

    bars = [error_bars(s) for s in report.slices]
    data = [
        {
            "type": "bar",
            "name": "mean KLD (95% CI)",
            "x": names,
            "y": [s.mean_kld for s in report.slices],
            "error_y": {
                "type": "data",
                "symmetric": False,
                "array": [b[0] for b in bars],
                "arrayminus": [b[1] for b in bars],
            },
            "marker": {"color": COLOURS[0]},
            "hovertemplate": "%{x}: mean KLD %{y:.4f}<extra></extra>",
        },
        {
            "type": "bar",
            "name": "p99 KLD",
            "x": names,
            "y": [s.p99_kld for s in report.slices],
            "marker": {"color": COLOURS[5]},
            "hovertemplate": "%{x}: p99 KLD %{y:.4f}<extra></extra>",
        },
    ]
    return {
        "data": data,
        "layout": _layout(
            "KL divergence vs reference, per slice", y_title="nats", barmode="group"
        ),
    }


def quality_top1_figure(report: QualityReport | None) -> dict | None:
    if report is None or not report.slices:
        return None
    data = [
        {
            "type": "bar",
            "name": "same top-1",
            "x": [s.name for s in report.slices],
            "y": [s.same_top1 * 100 for s in report.slices],
            "text": [
                f"{s.flips} flip{'s' if s.flips != 1 else ''}" for s in report.slices
            ],
            "textposition": "inside",
            "marker": {"color": COLOURS[2]},
            "hovertemplate": "%{x}: %{y:.1f}% same top-1, %{text}<extra></extra>",
        }
    ]
    return {
        "data": data,
        "layout": _layout(
            "Same top-1 (%) and flips, per slice",
            y_title="%",
            showlegend=False,
            yaxis={
                "title": {"text": "%"},
                "range": [
                    max(0, min(s.same_top1 for s in report.slices) * 100 - 5),
                    100,
                ],
                "automargin": True,
            },
        ),
    }


def cost_figure(columns: list[tuple[str, LoadTestReport | None]]) -> dict | None:
    present = [(label, r) for label, r in columns if r is not None and r.workloads]
    if not present:
        return None
    data = []
    for position, (label, report) in enumerate(present):
        data.append(
            {
                "type": "bar",
                "name": label,
                "x": [w.profile for w in report.workloads],
                "y": [w.cost_per_1m_output_tokens for w in report.workloads],
                "marker": {"color": COLOURS[position % len(COLOURS)]},
                "hovertemplate": "%{x}: $%{y:.3f} per 1M output tokens"
                "<extra>" + label + "</extra>",
            }
        )
    return {
        "data": data,
        "layout": _layout(
            "USD per 1M output tokens at SLO",
            y_title="USD",
            barmode="group",
        ),
    }


def timeline_figure(stages) -> dict | None:
    """One horizontal bar per job from its start to its end (or now), on a date axis."""
    started = [s for s in stages if s.job.started is not None]
    if not started:
        return None
    colour = {
        "succeeded": "#2e7d32",
        "pass": "#2e7d32",
        "failed": "#c62828",
        "fail": "#c62828",
        "running": "#1565c0",
        "inconclusive": "#f9a825",
        "skipped": "#b0bec5",
    }
    labels = [f"{s.kind} #{s.job.attempts}" for s in started]
    data = [
        {
            "type": "bar",
            "orientation": "h",
            "y": labels,
            "base": [s.job.started.isoformat() for s in started],
            "x": [(s.duration_s or 0) * 1000 for s in started],
            "marker": {
                "color": [
                    "#ef6c00" if s.health.stuck else colour.get(s.outcome.label, "#777")
                    for s in started
                ]
            },
            "customdata": [
                f"{s.duration_s or 0:.3f} s, {s.outcome.label}" for s in started
            ],
            "hovertemplate": "%{y}: %{customdata}<extra></extra>",
            "name": "stages",
        }
    ]
    layout = _layout("Pipeline timeline", showlegend=False)
    layout["xaxis"] = {"type": "date", "automargin": True}
    layout["yaxis"] = {"autorange": "reversed", "automargin": True}
    layout["height"] = 80 + 28 * len(started)
    return {"data": data, "layout": layout}
