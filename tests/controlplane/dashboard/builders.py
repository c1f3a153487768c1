"""Releases with recorded evidence, built the way the pipeline builds them: every job
through do_start_job/do_finish_job, reports made from the pydantic classes of
gpuagent/protocol.py (so a report that breaks the contract fails here first), the
manifest through do_record_manifest, every move through do_transition_release.

The numbers are those of an 8B Llama-class model (32 layers, 8 KV heads of 128) on
one 80 GB GPU: bytes per token and sessions follow from the recipe by the formula in
REFERENCE.md; latency and throughput are made up but shaped like a real sweep: a
closed-loop concurrency sweep, an open-loop arrival-rate sweep, a context-length sweep
(rag) and prefix-cache hit rates (chat, multi-turn) as the server would report them.
The reports' own USD fields are filled as the agent fills them; the control plane
ignores them and prices with the environment's cost model (`set_price`).
"""

import hashlib

from controlplane.releases.actions.approvals import do_approve_release
from controlplane.releases.actions.deployments import (
    do_complete_deployment,
    do_start_deployment,
)
from controlplane.releases.actions.gate_results import do_record_gate_result
from controlplane.releases.actions.jobs import do_finish_job, do_start_job
from controlplane.releases.actions.manifests import do_record_manifest
from controlplane.releases.actions.transitions import do_transition_release
from gpuagent.protocol import (
    CompressJobResult,
    CompressResult,
    ExpertFallback,
    FileDigest,
    Interval,
    LayerRouting,
    LoadRun,
    LoadTestReport,
    Percentiles,
    QualityReport,
    Recipe,
    RoutingReport,
    SliceQuality,
    WorkloadReport,
)

WORKER = "system:worker"
ENDPOINT = "http://10.0.0.7:8100/v1"
GPU_BYTES = 80 * 10**9
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
ELEMENT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
WEIGHT_BYTES = {
    "bf16": 16_060_000_000,
    "fp16": 16_060_000_000,
    "int8": 8_540_000_000,
    "int4-g128": 5_730_000_000,
}
# profile -> (prompt tokens, output tokens, TTFT SLO p99 ms, TPOT SLO p99 ms)
WORKLOADS = {
    "chat": (512, 256, 800.0, 60.0),
    "rag": (7680, 256, 3000.0, 80.0),
    "code": (2048, 512, 1500.0, 70.0),
}
CONCURRENCY = (1, 8, 32, 64)
# Open-loop arrival rates as a share of the workload's closed-loop rate at 32.
ARRIVAL_SHARES = (0.25, 0.5, 1.0, 1.5)
CONTEXT_SWEEP = (1024, 4096, 16384)
# Multi-turn chat reuses its history: the hit rate falls as load evicts blocks.
HIT_RATES = {"chat": (0.82, 0.8, 0.74, 0.6)}
QUALITY_SLICES = {"english": 1.0, "code": 1.3, "korean": 1.8, "long_context": 2.4}


def kv_bytes_per_token(kv_cache_dtype: str) -> int:
    data = 2 * LAYERS * KV_HEADS * HEAD_DIM * ELEMENT_BYTES[kv_cache_dtype]
    scales = 0 if kv_cache_dtype in ("bf16", "fp16") else 2 * LAYERS * KV_HEADS * 2
    return int(data + scales)


def _percentiles(p50: float) -> Percentiles:
    return Percentiles(p50=p50, p90=p50 * 1.5, p95=p50 * 1.8, p99=p50 * 2.4)


def _run(profile, concurrency, *, speed, sessions, prompt=None, rate=None, hit=None):
    """One load level: closed loop at `concurrency`, or open loop at `rate` req/s
    (then `concurrency` is the in-flight load it amounts to)."""
    default_prompt, output, slo_ttft, slo_tpot = WORKLOADS[profile]
    prompt = prompt or default_prompt
    tpot = 12.0 * (1 + concurrency / 24) / speed
    ttft = (40.0 + prompt / 40) * (1 + concurrency / 16) / speed
    e2e = ttft + tpot * (output - 1)
    requests_per_s = concurrency / (e2e / 1000)
    meets_slo = ttft * 2.4 <= slo_ttft and tpot * 2.4 <= slo_tpot
    served = requests_per_s if rate is None else min(rate, requests_per_s)
    return LoadRun(
        concurrency=None if rate is not None else concurrency,
        request_rate=rate,
        arrival="closed" if rate is None else "poisson",
        num_requests=concurrency * 8,
        num_errors=0,
        duration_s=concurrency * 8 / requests_per_s,
        ttft_ms=_percentiles(ttft),
        tpot_ms=_percentiles(tpot),
        itl_ms=_percentiles(tpot * 0.95),
        e2e_ms=_percentiles(e2e),
        request_throughput=served,
        output_tokens_per_s=served * output,
        goodput=served if meets_slo else served * 0.4,
        meets_slo=meets_slo,
        valid=True,
        peak_concurrent_sequences=min(concurrency, sessions),
        prompt_tokens=prompt,
        output_tokens=int(concurrency * 8 * output),
        prefix_cache_hit_rate=hit,
    )


def _workload(profile: str, *, speed: float, sessions: int, hourly: float):
    prompt, output, slo_ttft, slo_tpot = WORKLOADS[profile]
    hits = HIT_RATES.get(profile, (None,) * len(CONCURRENCY))
    runs = [
        _run(profile, c, speed=speed, sessions=sessions, hit=hit)
        for c, hit in zip(CONCURRENCY, hits, strict=True)
    ]
    closed_at_32 = runs[2].request_throughput
    open_loop = [
        _run(
            profile,
            int(32 * share),
            speed=speed,
            sessions=sessions,
            rate=round(closed_at_32 * share, 3),
        )
        for share in ARRIVAL_SHARES
    ]
    sweep = []
    if profile == "rag":
        sweep = [
            _run(profile, 8, speed=speed, sessions=sessions, prompt=length)
            for length in CONTEXT_SWEEP
        ]
    at_slo = [r for r in runs if r.meets_slo]
    best = at_slo[-1] if at_slo else None
    return WorkloadReport(
        profile=profile,
        prompt_tokens=prompt,
        output_tokens=output,
        context_tokens=prompt + output,
        slo_ttft_p99_ms=slo_ttft,
        slo_tpot_p99_ms=slo_tpot,
        runs=runs + open_loop,
        context_sweep=sweep,
        ttft_p99_ms=best.ttft_ms.p99 if best else None,
        tpot_p99_ms=best.tpot_ms.p99 if best else None,
        max_concurrency_at_slo=best.concurrency if best else None,
        output_tokens_per_s_at_slo=best.output_tokens_per_s if best else None,
        max_sessions_at_context=sessions,
        cost_per_1m_output_tokens=(
            hourly / (best.output_tokens_per_s * 3600) * 1e6 if best else None
        ),
        cost_per_request=hourly / (best.request_throughput * 3600) if best else None,
        requests_per_gpu_hour=best.request_throughput * 3600 if best else None,
    )


def load_test_report(
    recipe: dict, *, speed: float = 1.0, gpu_hourly_usd: float = 2.5
) -> LoadTestReport:
    weights = WEIGHT_BYTES[recipe["weights"]]
    per_token = kv_bytes_per_token(recipe["kv_cache_dtype"])
    budget = int(GPU_BYTES * 0.9) - weights
    workloads = [
        _workload(
            profile,
            speed=speed,
            sessions=budget // (per_token * (prompt + output)),
            hourly=gpu_hourly_usd,
        )
        for profile, (prompt, output, _, _) in WORKLOADS.items()
    ]
    return LoadTestReport(
        endpoint=ENDPOINT,
        gpu_hourly_usd=gpu_hourly_usd,
        gpu_count=1,
        weights_bytes=weights,
        kv_budget_bytes=budget,
        kv_bytes_per_token=per_token,
        kv_cache_dtype=recipe["kv_cache_dtype"],
        workloads=workloads,
    )


DENSE_ROUTING = RoutingReport(
    status="not_applicable", reason="dense model: no routed experts"
)


def moe_routing(*agreements: float, shift: float = 0.01) -> RoutingReport:
    """A measured routing report: one MoE layer (1, 2, ...) per agreement."""
    layers = [
        LayerRouting(
            layer=index,
            num_tokens=4096,
            router_agreement=agreement,
            router_agreement_ci95=Interval(
                low=agreement - 0.02, high=min(1.0, agreement + 0.02)
            ),
            mean_jaccard=min(1.0, agreement + 0.04),
            load_shift=shift * index,
            max_load_change=0.1 * index,
            max_load_change_expert=index + 7,
        )
        for index, agreement in enumerate(agreements or (0.93, 0.88), start=1)
    ]
    return RoutingReport.measured(layers, num_experts=256, top_k=8)


def quality_report(
    release, *, kld: float = 0.004, routing: RoutingReport | None = DENSE_ROUTING
) -> QualityReport:
    slices = []
    for name, hardness in QUALITY_SLICES.items():
        mean = kld * hardness
        slices.append(
            SliceQuality(
                name=name,
                num_tokens=4096,
                mean_kld=mean,
                mean_kld_ci95=Interval(low=mean * 0.85, high=mean * 1.15),
                p99_kld=mean * 9,
                max_kld=mean * 30,
                same_top1=max(0.0, 1 - mean * 6),
                ppl_candidate=12.0 * (1 + mean),
                ppl_reference=12.0,
                ppl_ratio=1 + mean,
                num_continuations=64,
                exact_match=max(0.0, 1 - mean * 20),
                flips=round(mean * 400),
                retrieval_ok=True if name == "long_context" else None,
            )
        )
    return QualityReport(
        candidate=str(release),
        reference=f"{release.model.name} bf16 (parent)",
        method="in_process",
        seed=0,
        slices=slices,
        routing=routing,
    )


def record_job(release, kind: str, result: dict, *, agent=None):
    job = do_start_job(release, kind, agent=agent)
    return do_finish_job(job, result=result)


def compress_result(
    release,
    *,
    parameters: tuple[int, int] | None = None,
    fallbacks: tuple[tuple[int, int, int], ...] = (),
    min_expert_tokens: int | None = None,
) -> CompressJobResult:
    """What the compress job returns: a dense model's report, or with
    `parameters` (total, active) an MoE model's, its `fallbacks` (layer, expert,
    tokens) rounded to nearest below `min_expert_tokens` (None: not calibrated)."""
    recipe = Recipe.model_validate(release.recipe)
    before = 16_060_000_000
    after = WEIGHT_BYTES.get(recipe.weights, before)
    return CompressJobResult(
        candidate=f"candidates/{release.model.name}-{release.version}",
        weights=recipe.weights,
        kv_cache_dtype=recipe.kv_cache_dtype,
        source_manifest_digest="sha256:" + "0" * 64,
        size_bytes=after,
        source_size_bytes=before,
        report=CompressResult(
            out_dir=f"candidates/{release.model.name}-{release.version}",
            recipe=recipe,
            quantized_layers=LAYERS,
            sizes=[],
            total_bytes_before=before,
            total_bytes_after=after,
            expected_gpu_weight_bytes=after,
            kv_scales=False,
            rtn_fallback_experts=[
                ExpertFallback(layer=layer, expert=expert, tokens=tokens)
                for layer, expert, tokens in fallbacks
            ],
            min_expert_tokens=min_expert_tokens,
            total_parameters=parameters[0] if parameters else None,
            active_parameters=parameters[1] if parameters else None,
            seconds=12.5,
        ),
    )


def record_manifest(release, salt: str = ""):
    files = []
    for path, size in (
        ("config.json", 712),
        ("model-00001-of-00002.safetensors", 4_980_000_000),
        ("model-00002-of-00002.safetensors", 750_000_000),
    ):
        digest = hashlib.sha256(f"{release.model.name}:{path}:{salt}".encode())
        files.append(
            FileDigest(
                path=path, size_bytes=size, digest="sha256:" + digest.hexdigest()
            )
        )
    manifest = hashlib.sha256("".join(f.digest for f in files).encode()).hexdigest()
    # The dashboard only shows whether a signature is recorded (verifying it is the
    # agent's job), so a stand-in bundle that says what it is will do here.
    signature = '{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json"}'
    do_record_manifest(
        release, manifest_digest="sha256:" + manifest, files=files, signature=signature
    )
    return "sha256:" + manifest


def to_awaiting_approval(
    release,
    *,
    agent=None,
    speed: float = 1.0,
    kld: float = 0.004,
    salt=None,
    routing: RoutingReport | None = DENSE_ROUTING,
):
    """registered -> awaiting_approval with every stage's job, the manifest, a
    quality and a load report and passing gates recorded as the worker would."""
    do_transition_release(release, "verifying", actor=WORKER)
    record_job(release, "verify_source", {"report": {"ok": True}}, agent=agent)
    do_transition_release(release, "compressing", actor=WORKER)
    compressed = compress_result(release).model_dump(mode="json")
    record_job(release, "compress", compressed, agent=agent)
    digest = record_manifest(release, salt=release.version if salt is None else salt)
    record_job(
        release,
        "sign",
        {"manifest_digest": digest, "signer": "ci-signing@acme.example"},
        agent=agent,
    )
    record_job(
        release,
        "verify",
        {"ok": True, "manifest_digest": digest, "signer": "ci-signing@acme.example"},
        agent=agent,
    )
    do_transition_release(release, "evaluating", actor=WORKER)
    quality = quality_report(release, kld=kld, routing=routing)
    load = load_test_report(release.recipe, speed=speed)
    record_job(release, "evaluate", quality.model_dump(mode="json"), agent=agent)
    record_job(release, "load_test", load.model_dump(mode="json"), agent=agent)
    overall = quality.slices[0]
    do_record_gate_result(
        release,
        gate="quality",
        metric="english.mean_kld",
        observed=overall.mean_kld,
        threshold=0.03,
        outcome="pass",
        reason="within the good 4-bit grade",
    )
    chat = load.workloads[0]
    do_record_gate_result(
        release,
        gate="latency",
        metric="chat.ttft_p99_ms",
        observed=chat.ttft_p99_ms,
        threshold=chat.slo_ttft_p99_ms,
        outcome="pass",
    )
    do_transition_release(release, "gated", actor=WORKER)
    record_job(release, "gate", {"outcome": "pass"}, agent=None)
    do_transition_release(release, "awaiting_approval", actor=WORKER)
    release.refresh_from_db()
    return release


def take_live(release, approver, *, agent=None, endpoint=ENDPOINT):
    """awaiting_approval -> live: approved by `approver` for its digest, deployed on
    `agent` through the deployment actions (the queued task is the caller's to
    swallow or run)."""
    do_approve_release(release, approver, manifest_digest=release.manifest_digest)
    deployment = do_start_deployment(release, actor=WORKER, agent=agent)
    do_complete_deployment(deployment, actor=WORKER, endpoint=endpoint)
    release.refresh_from_db()
    return release


def set_price(environment, actor, price="2.50", **cost_model):
    """Give `environment` a cost model through the action (audited like any)."""
    from controlplane.costs.actions import do_set_cost_model

    spec = {"currency": "USD", "device_hourly_price": price, **cost_model}
    return do_set_cost_model(environment, spec, actor=actor)
