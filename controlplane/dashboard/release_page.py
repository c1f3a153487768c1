"""Everything the release detail page shows about one release's evidence, gathered in
one place: its reports and those of its parent and of the release live in its target
environment, the charts drawn from them, and what differs from live."""

from dataclasses import dataclass, field

from controlplane.dashboard import charts
from controlplane.dashboard.comparison import LiveComparison, compare_with_live
from controlplane.releases import evidence
from controlplane.releases.models import Release
from gpuagent.protocol import LoadTestReport, QualityReport

PERFORMANCE_CHARTS = (
    "memory",
    "throughput",
    "ttft",
    "tpot",
    "kv_bytes",
    "kv_sessions",
    "cost",
)
QUALITY_CHARTS = ("quality_kld", "quality_top1")


@dataclass
class ReleaseEvidence:
    quality: QualityReport | None = None
    load: LoadTestReport | None = None
    live_release: Release | None = None
    comparison: LiveComparison | None = None
    integrity: evidence.Integrity | None = None
    charts: dict[str, dict] = field(default_factory=dict)
    # Reports that were recorded but don't validate: shown, never taken as evidence.
    problems: list[str] = field(default_factory=list)

    @property
    def performance_charts(self) -> list[tuple[str, dict]]:
        return [(n, self.charts[n]) for n in PERFORMANCE_CHARTS if n in self.charts]

    @property
    def quality_charts(self) -> list[tuple[str, dict]]:
        return [(n, self.charts[n]) for n in QUALITY_CHARTS if n in self.charts]

    @property
    def headline_workloads(self) -> list[tuple]:
        if self.load is None:
            return []
        return [(w, charts.headline_run(w)) for w in self.load.workloads]


def _read(problems: list[str], reader, release: Release | None):
    if release is None:
        return None
    try:
        return reader(release)
    except evidence.EvidenceUnreadable as exc:
        problems.append(exc.message)
        return None


def live_release_for(release: Release) -> Release | None:
    """The release live (or failed verification) in `release`'s target environment,
    unless that is `release` itself."""
    deployment = release.target_environment.live_deployment
    if deployment is None or deployment.release_id == release.pk:
        return None
    return deployment.release


def release_evidence(release: Release) -> ReleaseEvidence:
    problems: list[str] = []
    page = ReleaseEvidence(problems=problems)
    page.quality = _read(problems, evidence.quality_report, release)
    page.load = _read(problems, evidence.load_report, release)
    page.integrity = evidence.integrity(release)
    page.live_release = live_release_for(release)
    parent = release.parent
    parent_load = _read(problems, evidence.load_report, parent)
    live_load = _read(problems, evidence.load_report, page.live_release)
    if page.live_release is not None:
        page.comparison = compare_with_live(
            release,
            page.live_release,
            candidate_load=page.load,
            live_load=live_load,
            candidate_quality=page.quality,
            live_quality=_read(problems, evidence.quality_report, page.live_release),
        )
    columns = [(f"candidate {release.version}", page.load)]
    if parent is not None:
        columns.append((f"parent {parent.version}", parent_load))
    if page.live_release is not None:
        columns.append((f"live {page.live_release.version}", live_load))
    figures = {
        "memory": charts.memory_figure(columns),
        "throughput": charts.throughput_figure(page.load),
        "ttft": charts.latency_figure(page.load, "ttft_ms"),
        "tpot": charts.latency_figure(page.load, "tpot_ms"),
        "kv_bytes": charts.kv_bytes_figure(columns),
        "kv_sessions": charts.kv_sessions_figure(columns),
        "quality_kld": charts.quality_kld_figure(page.quality),
        "quality_top1": charts.quality_top1_figure(page.quality),
        "cost": charts.cost_figure(columns),
    }
    page.charts = {name: figure for name, figure in figures.items() if figure}
    return page
