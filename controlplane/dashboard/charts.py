"""Plotly figures (plain dicts: data + layout) from the evidence reports.

Each function takes reports from `controlplane.releases.evidence` and returns a figure
that static/dashboard/charts.js hands to Plotly.newPlot unchanged; a figure is None
when there is nothing to draw, and the page says what evidence is missing instead.
"""

from controlplane.costs.capacity import run_costs
from controlplane.costs.money import Pricing
from controlplane.costs.report import WorkloadEconomics
from gpuagent.protocol import LoadTestReport, QualityReport

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


def latency_figure(rows: dict[str, WorkloadEconomics], metric: str) -> dict | None:
    """Percentiles of `metric` ("ttft_ms" or "tpot_ms") per workload at its SLO
    operating point, with the p99 SLO of the gate policy in force."""
    rows = {name: row for name, row in rows.items() if row.operating_point}
    if not rows:
        return None
    name = metric.removesuffix("_ms").upper()
    profiles = list(rows)
    data = [
        {
            "type": "bar",
            "name": percentile,
            "x": profiles,
            "y": [
                getattr(getattr(row.operating_point, metric), percentile)
                for row in rows.values()
            ],
            "marker": {"color": COLOURS[position]},
            "hovertemplate": f"{percentile} %{{y:.1f}} ms<extra></extra>",
        }
        for position, percentile in enumerate(PERCENTILES)
    ]
    slo_field = f"{metric.removesuffix('_ms')}_p99_ms"
    data.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "SLO p99 (gate policy)",
            "x": profiles,
            "y": [getattr(row.slo, slo_field) for row in rows.values()],
            "marker": {"color": "#000", "symbol": "line-ew-open", "size": 28},
            "hovertemplate": "SLO p99 %{y:.0f} ms<extra></extra>",
        }
    )
    return {
        "data": data,
        "layout": _layout(
            f"{name} p50–p99 at the SLO operating point",
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


def cost_figure(
    columns: list[tuple[str, dict[str, WorkloadEconomics], str]],
) -> dict | None:
    """Cost per 1M output tokens at the SLO per workload, one bar series per
    (label, economics, currency) column; None when nothing is priced."""
    present = [
        (label, rows, currency)
        for label, rows, currency in columns
        if any(_priced(row) for row in rows.values())
    ]
    if not present:
        return None
    data = []
    for position, (label, rows, currency) in enumerate(present):
        data.append(
            {
                "type": "bar",
                "name": f"{label} ({currency})",
                "x": list(rows),
                "y": [
                    _float(row.costs.cost_per_1m_output_tokens if row.costs else None)
                    for row in rows.values()
                ],
                "marker": {"color": COLOURS[position % len(COLOURS)]},
                "hovertemplate": f"%{{x}}: %{{y}} {currency} per 1M output tokens"
                "<extra>" + label + "</extra>",
            }
        )
    currencies = {currency for _, _, currency in present}
    unit = currencies.pop() if len(currencies) == 1 else "each release's currency"
    return {
        "data": data,
        "layout": _layout(
            "Cost per 1M output tokens at the SLO", y_title=unit, barmode="group"
        ),
    }


def _priced(row: WorkloadEconomics) -> bool:
    return bool(row.costs and row.costs.cost_per_1m_output_tokens is not None)


def _float(value) -> float | None:
    return None if value is None else float(value)


# Candidate and live on the same axes: a colour per workload where workloads share
# a chart, a line style per release.
DASHES = ("solid", "dash", "dot")
SLO_LINE = {"color": "#000", "dash": "dot", "width": 1}

Sides = list[tuple[str, dict[str, WorkloadEconomics]]]
_Y = {"automargin": True, "rangemode": "tozero"}


def _slo_trace(x: list, value: float, name: str, yaxis: str = "y", **line) -> dict:
    return {
        "type": "scatter",
        "mode": "lines",
        "name": name,
        "legendgroup": name,
        "x": [min(x), max(x)],
        "y": [value, value],
        "yaxis": yaxis,
        "line": {**SLO_LINE, **line},
        "hovertemplate": f"{name} %{{y:.0f}} ms<extra></extra>",
    }


def load_curves_figure(profile: str, sides: Sides) -> dict | None:
    """One workload over closed-loop concurrency, each release of `sides` (label,
    economics) on the same axes: output tokens/s, TTFT p99 and TPOT p99 stacked,
    with the knee (max concurrency at the SLO) starred and the SLO of the gate
    policy in force dotted. None when no side has a closed-loop run."""
    data, xs, slo = [], [], None
    for position, (label, rows) in enumerate(sides):
        row = rows.get(profile)
        if row is None:
            continue
        runs = sorted(
            (r for r in row.workload.runs if r.concurrency is not None),
            key=lambda r: r.concurrency,
        )
        if not runs:
            continue
        slo = slo or row.slo
        x = [r.concurrency for r in runs]
        xs += x
        style = {"color": COLOURS[position], "dash": DASHES[position % len(DASHES)]}
        symbols = ["circle" if row.slo.met_by(r) else "x" for r in runs]
        for axis, metric, values in (
            ("y", "output tok/s", [r.output_tokens_per_s for r in runs]),
            ("y2", "TTFT p99 ms", [r.ttft_ms.p99 for r in runs]),
            ("y3", "TPOT p99 ms", [r.tpot_ms.p99 for r in runs]),
        ):
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": label,
                    "legendgroup": label,
                    "showlegend": axis == "y",
                    "x": x,
                    "y": values,
                    "yaxis": axis,
                    "line": style,
                    "marker": {"color": style["color"], "symbol": symbols, "size": 7},
                    "hovertemplate": f"{label}<br>%{{x}} concurrent: %{{y:.1f}} "
                    f"{metric}<extra></extra>",
                }
            )
        if row.knee is not None:
            at_knee = next(r for r in runs if r.concurrency == row.knee)
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers+text",
                    "name": f"knee ({label})",
                    "x": [row.knee],
                    "y": [at_knee.output_tokens_per_s],
                    "text": [f"knee {row.knee}"],
                    "textposition": "top center",
                    "marker": {"color": style["color"], "symbol": "star", "size": 15},
                    "hovertemplate": f"{label}: max concurrency at the SLO "
                    "%{x}<extra></extra>",
                }
            )
    if not data:
        return None
    if slo.ttft_p99_ms is not None:
        data.append(_slo_trace(xs, slo.ttft_p99_ms, "SLO (gate policy)", "y2"))
    if slo.tpot_p99_ms is not None:
        trace = _slo_trace(xs, slo.tpot_p99_ms, "SLO (gate policy)", "y3")
        data.append({**trace, "showlegend": slo.ttft_p99_ms is None})
    layout = _layout(
        f"{profile}: throughput and p99 latency vs concurrency (★ knee, x: SLO missed)",
        height=560,
        xaxis={
            "title": {"text": "concurrent requests"},
            "anchor": "y3",
            "automargin": True,
        },
        yaxis={"title": {"text": "output tok/s"}, "domain": [0.7, 1], **_Y},
        yaxis2={"title": {"text": "TTFT p99 ms"}, "domain": [0.36, 0.64], **_Y},
        yaxis3={"title": {"text": "TPOT p99 ms"}, "domain": [0, 0.3], **_Y},
    )
    layout["legend"] = {**layout["legend"], "y": -0.12}
    return {"data": data, "layout": layout}


def _runs_by_workload(sides: Sides, runs_of, x_of) -> list[tuple]:
    """(workload colour index, side index, workload, side label, its economics,
    its runs that have an x) for every workload of every side with such runs;
    `runs_of(row)` gives the runs, `x_of(run)` their x (None: not on this chart),
    and they come sorted by it."""
    names = list(dict.fromkeys(name for _, rows in sides for name in rows))
    found = []
    for side, (label, rows) in enumerate(sides):
        for name, row in rows.items():
            runs = sorted((r for r in runs_of(row) if x_of(r) is not None), key=x_of)
            if runs:
                found.append((names.index(name), side, name, label, row, runs))
    return found


def _series(colour: int, side: int, name: str, label: str, x, y, hover: str) -> dict:
    return {
        "type": "scatter",
        "mode": "lines+markers",
        "name": f"{name} · {label}",
        "x": x,
        "y": y,
        "line": {
            "color": COLOURS[colour % len(COLOURS)],
            "dash": DASHES[side % len(DASHES)],
        },
        "marker": {"color": COLOURS[colour % len(COLOURS)], "size": 7},
        "hovertemplate": f"{name} · {label}<br>{hover}<extra></extra>",
    }


def context_figure(sides: Sides) -> dict | None:
    """TTFT p99 vs prompt length (each workload's context sweep), candidate and
    live on the same axes, with each workload's TTFT SLO dotted."""
    # prompt_tokens 0: the client got no usage, so the length is unknown.
    found = _runs_by_workload(
        sides, lambda row: row.workload.context_sweep, lambda r: r.prompt_tokens or None
    )
    if not found:
        return None
    data, slos = [], {}
    for colour, side, name, label, row, runs in found:
        x = [r.prompt_tokens for r in runs]
        data.append(
            _series(
                colour,
                side,
                name,
                label,
                x,
                [r.ttft_ms.p99 for r in runs],
                "%{x} prompt tokens: TTFT p99 %{y:.0f} ms",
            )
        )
        if row.slo.ttft_p99_ms is not None:
            slos.setdefault(name, (colour, row.slo.ttft_p99_ms, []))[2].extend(x)
    for name, (colour, value, x) in slos.items():
        data.append(
            _slo_trace(
                x, value, f"{name} TTFT SLO", color=COLOURS[colour % len(COLOURS)]
            )
        )
    return {
        "data": data,
        "layout": _layout(
            "TTFT p99 vs context length (dotted: SLO)",
            "prompt tokens",
            "TTFT p99 ms",
        ),
    }


def goodput_figure(sides: Sides) -> dict | None:
    """Goodput (requests/s meeting the SLO) vs the open-loop arrival rate; the
    diagonal is every request meeting it."""
    found = _runs_by_workload(
        sides, lambda row: row.workload.runs, lambda r: r.request_rate
    )
    if not found:
        return None
    data, rates = [], []
    for colour, side, name, label, _, runs in found:
        x = [r.request_rate for r in runs]
        rates += x
        data.append(
            _series(
                colour,
                side,
                name,
                label,
                x,
                [r.goodput for r in runs],
                "%{x} req/s offered: %{y:.2f} req/s met the SLO",
            )
        )
    data.append(
        {
            "type": "scatter",
            "mode": "lines",
            "name": "offered (all met the SLO)",
            "x": [0, max(rates)],
            "y": [0, max(rates)],
            "line": {"color": "#999", "dash": "dot", "width": 1},
            "hoverinfo": "skip",
        }
    )
    return {
        "data": data,
        "layout": _layout(
            "Goodput vs arrival rate (open loop)",
            "arrival rate (req/s)",
            "goodput (req/s)",
        ),
    }


def reuse_figure(sides: Sides, pricing: Pricing) -> dict | None:
    """Each run's cost per request against the prefix-cache hit rate the server
    reported (the reuse it saw); requests per device-hour when the environment
    has no price. Runs missing the SLO are crosses."""
    found = _runs_by_workload(
        sides,
        lambda row: row.workload.runs,
        lambda r: r.prefix_cache_hit_rate,
    )
    if not found:
        return None
    data = []
    for colour, side, name, label, row, runs in found:
        costs = [
            run_costs(r, row.workload, pricing, row.measured_devices) for r in runs
        ]
        if pricing.priced:
            y = [_float(c.cost_per_request) for c in costs]
            hover = f"hit rate %{{x:.0f}}%: %{{y}} {pricing.currency} per request"
        else:
            y = [c.requests_per_device_hour for c in costs]
            hover = "hit rate %{x:.0f}%: %{y:.0f} requests per device-hour"
        trace = _series(
            colour,
            side,
            name,
            label,
            [r.prefix_cache_hit_rate * 100 for r in runs],
            y,
            hover,
        )
        trace["mode"] = "markers"
        trace["marker"]["symbol"] = [
            "circle" if row.slo.met_by(r) else "x" for r in runs
        ]
        data.append(trace)
    if pricing.priced:
        title, y_title = "Cost per request vs prefix-cache hit rate", pricing.currency
    else:
        title = "Requests per device-hour vs prefix-cache hit rate (no price set)"
        y_title = "requests per device-hour"
    return {
        "data": data,
        "layout": _layout(title, "prefix-cache hit rate (%)", y_title),
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
