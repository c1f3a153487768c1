"""What differs between a candidate and the release live in its target environment:
recipe, manifest, files, and the measured numbers both have. A candidate whose
manifest digest is exactly the live one's is flagged: approving it ships nothing new
(a re-registration of the same bytes, or a mix-up)."""

from dataclasses import dataclass, field

from gpuagent.protocol import LoadTestReport, QualityReport

GIB = 2**30


@dataclass(frozen=True)
class Difference:
    what: str
    candidate: str
    live: str


@dataclass(frozen=True)
class LiveComparison:
    live: object  # the live Release
    same_digest: bool
    differences: list[Difference] = field(default_factory=list)
    files_added: list[str] = field(default_factory=list)
    files_removed: list[str] = field(default_factory=list)
    files_changed: list[str] = field(default_factory=list)


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    return f"{text}{unit}"


def compare_with_live(
    candidate,
    live,
    *,
    candidate_load: LoadTestReport | None = None,
    live_load: LoadTestReport | None = None,
    candidate_quality: QualityReport | None = None,
    live_quality: QualityReport | None = None,
) -> LiveComparison:
    rows = [
        ("version", candidate.version, live.version),
        ("weights", candidate.recipe.get("weights"), live.recipe.get("weights")),
        (
            "KV cache dtype",
            candidate.recipe.get("kv_cache_dtype"),
            live.recipe.get("kv_cache_dtype"),
        ),
        ("manifest digest", candidate.manifest_digest, live.manifest_digest),
        ("source", candidate.source_uri, live.source_uri),
    ]
    if candidate_load and live_load:
        rows += [
            (
                "weights (GiB)",
                candidate_load.weights_bytes / GIB,
                live_load.weights_bytes / GIB,
            ),
            (
                "KV bytes per token",
                candidate_load.kv_bytes_per_token,
                live_load.kv_bytes_per_token,
            ),
        ]
        live_workloads = {w.profile: w for w in live_load.workloads}
        for workload in candidate_load.workloads:
            other = live_workloads.get(workload.profile)
            if other is None:
                continue
            # Money and capacity against live: the page's capacity plan, priced
            # by the environment's cost model (the reports' USD fields are not).
            rows += [
                (
                    f"{workload.profile}: sessions at {workload.context_tokens} tokens",
                    workload.max_sessions_at_context,
                    other.max_sessions_at_context,
                ),
                (
                    f"{workload.profile}: TTFT p99 at SLO (ms)",
                    workload.ttft_p99_ms,
                    other.ttft_p99_ms,
                ),
            ]
    if candidate_quality and live_quality:
        live_slices = {s.name: s for s in live_quality.slices}
        for quality_slice in candidate_quality.slices:
            other = live_slices.get(quality_slice.name)
            if other is not None:
                rows.append(
                    (
                        f"{quality_slice.name}: mean KLD vs its reference",
                        quality_slice.mean_kld,
                        other.mean_kld,
                    )
                )
        mine, theirs = candidate_quality.routing, live_quality.routing
        if mine and theirs and mine.status == theirs.status == "measured":
            rows += [
                (
                    "router agreement vs its reference (worst MoE layer)",
                    mine.min_router_agreement,
                    theirs.min_router_agreement,
                ),
                (
                    "expert-load shift vs its reference (worst MoE layer)",
                    mine.max_load_shift,
                    theirs.max_load_shift,
                ),
            ]
    differences = [
        Difference(what, _fmt(mine), _fmt(theirs))
        for what, mine, theirs in rows
        if mine != theirs
    ]
    # Imported late, like stages.py does: gpuagent.integrity takes ~1 s to import.
    from gpuagent.integrity.manifest import diff_files

    # Against the live files: "missing" ones are gone in the candidate, "extra" new.
    removed, added, changed = diff_files(
        {a.path: a.digest for a in live.artifacts.all()},
        {a.path: a.digest for a in candidate.artifacts.all()},
    )
    return LiveComparison(
        live=live,
        same_digest=bool(candidate.manifest_digest)
        and candidate.manifest_digest == live.manifest_digest,
        differences=differences,
        files_added=added,
        files_removed=removed,
        files_changed=changed,
    )
