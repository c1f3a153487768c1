"""Everything the release detail page shows about one release's evidence, gathered in
one place: its reports and those of its parent and of the release live in its target
environment, the charts drawn from them, what differs from live, its money and
capacity (controlplane.costs.report) against live, (MoE) its routing against
its parent per layer with the gate policy's routing thresholds, and what its
compress job reported (MoE: total vs active parameters, experts rounded to
nearest)."""

from dataclasses import dataclass, field

from controlplane.costs.report import ReleaseCosts, economics, release_costs
from controlplane.dashboard import charts
from controlplane.dashboard.comparison import LiveComparison, compare_with_live
from controlplane.releases import evidence
from controlplane.releases.gates import RoutingThresholds
from controlplane.releases.models import Release
from gpuagent.protocol import (
    CompressJobResult,
    LoadTestReport,
    QualityReport,
    RoutingReport,
    ServingEngine,
)

PERFORMANCE_CHARTS = (
    "memory",
    "ttft",
    "tpot",
    "context",
    "goodput",
    "reuse",
    "kv_bytes",
    "kv_sessions",
    "cost",
)
QUALITY_CHARTS = ("quality_kld", "quality_top1")
WORKLOAD_CHART_PREFIX = "load-"


@dataclass
class ReleaseEvidence:
    quality: QualityReport | None = None
    load: LoadTestReport | None = None
    live_release: Release | None = None
    comparison: LiveComparison | None = None
    integrity: evidence.Integrity | None = None
    costs: ReleaseCosts | None = None
    charts: dict[str, dict] = field(default_factory=dict)
    # Reports that were recorded but don't validate: shown, never taken as evidence.
    problems: list[str] = field(default_factory=list)
    # the environment's routing thresholds (None: not gated on routing)
    routing_thresholds: RoutingThresholds | None = None
    # what the compress job made: sizes, and (MoE) parameters and RTN fallbacks
    compression: CompressJobResult | None = None

    @property
    def active_fraction(self) -> float | None:
        """MoE: the share of the parameters one token runs through (None: not
        reported)."""
        report = self.compression.report if self.compression else None
        if report is None or not report.total_parameters:
            return None
        if report.active_parameters is None:
            return None
        return report.active_parameters / report.total_parameters

    @property
    def routing(self) -> RoutingReport | None:
        """The quality report's routing section (None: none reported)."""
        return self.quality.routing if self.quality is not None else None

    @property
    def performance_charts(self) -> list[tuple[str, dict]]:
        return [(n, self.charts[n]) for n in PERFORMANCE_CHARTS if n in self.charts]

    @property
    def workload_charts(self) -> list[tuple[str, dict]]:
        """Each workload's curves over concurrency, candidate and live."""
        return [
            (name, figure)
            for name, figure in self.charts.items()
            if name.startswith(WORKLOAD_CHART_PREFIX)
        ]

    @property
    def quality_engines(self) -> list[tuple[str, ServingEngine]]:
        """The servers that scored each side over HTTP (none in-process)."""
        if self.quality is None:
            return []
        sides = (
            ("candidate", self.quality.candidate_engine),
            ("reference", self.quality.reference_engine),
        )
        return [(side, engine) for side, engine in sides if engine is not None]

    @property
    def quality_charts(self) -> list[tuple[str, dict]]:
        return [(n, self.charts[n]) for n in QUALITY_CHARTS if n in self.charts]


def _read(problems: list[str], reader, release: Release | None):
    if release is None:
        return None
    try:
        return reader(release)
    except evidence.EvidenceUnreadable as exc:
        problems.append(exc.message)
        return None


def release_evidence(
    release: Release, *, targets: dict[str, float] | None = None
) -> ReleaseEvidence:
    """`targets`: requests/s per workload typed on the page (None: the
    environment's)."""
    problems: list[str] = []
    page = ReleaseEvidence(problems=problems)
    page.quality = _read(problems, evidence.quality_report, release)
    page.load = _read(problems, evidence.load_report, release)
    page.integrity = evidence.integrity(release)
    page.compression = _read(problems, evidence.compress_report, release)
    page.costs = costs = release_costs(release, targets=targets, load=page.load)
    problems += costs.env.problems
    page.live_release = costs.live_release
    quality_policy = costs.env.policy.quality
    page.routing_thresholds = quality_policy.routing if quality_policy else None
    parent = release.parent
    parent_load = _read(problems, evidence.load_report, parent)
    live_load = costs.env.live_load if page.live_release else None
    if page.live_release is not None:
        page.comparison = compare_with_live(
            release,
            page.live_release,
            candidate_load=page.load,
            live_load=live_load,
            candidate_quality=page.quality,
            live_quality=_read(problems, evidence.quality_report, page.live_release),
        )
    candidate_label = f"candidate {release.version}"
    columns = [(candidate_label, page.load)]
    money = [(candidate_label, costs.workloads, costs.currency)]
    sides = [(candidate_label, costs.workloads)]
    if parent is not None:
        columns.append((f"parent {parent.version}", parent_load))
        parent_rows = economics(parent_load, costs.env.policy, costs.env.pricing)
        money.append((f"parent {parent.version}", parent_rows, costs.currency))
    if page.live_release is not None:
        live_label = f"live {page.live_release.version}"
        columns.append((live_label, live_load))
        money.append((live_label, costs.live_workloads, costs.currency))
        sides.append((live_label, costs.live_workloads))
    figures = {
        "memory": charts.memory_figure(columns),
        "ttft": charts.latency_figure(costs.workloads, "ttft_ms"),
        "tpot": charts.latency_figure(costs.workloads, "tpot_ms"),
        "context": charts.context_figure(sides),
        "goodput": charts.goodput_figure(sides),
        "reuse": charts.reuse_figure(sides, costs.env.pricing),
        "kv_bytes": charts.kv_bytes_figure(columns),
        "kv_sessions": charts.kv_sessions_figure(columns),
        "quality_kld": charts.quality_kld_figure(page.quality),
        "quality_top1": charts.quality_top1_figure(page.quality),
        "cost": charts.cost_figure(money),
    }
    workloads = list(dict.fromkeys([*costs.workloads, *costs.live_workloads]))
    for position, name in enumerate(workloads):
        figures[f"{WORKLOAD_CHART_PREFIX}{position}"] = charts.load_curves_figure(
            name, sides
        )
    page.charts = {name: figure for name, figure in figures.items() if figure}
    return page
