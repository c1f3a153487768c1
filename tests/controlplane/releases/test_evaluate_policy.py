"""evaluate_policy over evidence shaped as gpuagent.protocol fixes it."""

import pytest
from pydantic import ValidationError

from controlplane.releases.gates import (
    CapacityThreshold,
    GatePolicy,
    LoadPolicy,
    QualityPolicy,
    SliceThresholds,
    WorkloadThresholds,
    evaluate_gates,
    evaluate_policy,
)
from gpuagent.protocol import (
    LOAD_PROFILES,
    QUALITY_SLICES,
    Interval,
    LoadRun,
    LoadTestReport,
    Percentiles,
    QualityReport,
    SliceQuality,
    WorkloadReport,
)


def quality_slice(name: str, **overrides) -> SliceQuality:
    fields = dict(
        name=name,
        num_tokens=4096,
        mean_kld=0.01,
        p99_kld=0.1,
        max_kld=0.5,
        same_top1=0.95,
        ppl_candidate=10.2,
        ppl_reference=10.0,
        ppl_ratio=1.02,
        num_continuations=40,
        exact_match=0.8,
        flips=4,
        retrieval_ok=True if name == "long_context" else None,
    )
    fields.update(overrides)
    return SliceQuality(**fields)


def quality_report(*slices: SliceQuality) -> QualityReport:
    return QualityReport(
        candidate="llama@int4",
        reference="llama@bf16",
        method="in_process",
        seed=0,
        slices=list(slices) or [quality_slice(name) for name in QUALITY_SLICES],
    )


def pct(p99: float) -> Percentiles:
    return Percentiles(p50=p99 / 2, p90=p99 * 0.8, p95=p99 * 0.9, p99=p99)


def run(ttft_p99=400.0, tpot_p99=40.0, valid=True) -> LoadRun:
    return LoadRun(
        concurrency=8,
        num_requests=100,
        num_errors=0,
        duration_s=30,
        ttft_ms=pct(ttft_p99),
        tpot_ms=pct(tpot_p99),
        itl_ms=pct(tpot_p99),
        e2e_ms=pct(5000),
        request_throughput=3,
        output_tokens_per_s=600,
        goodput=3,
        meets_slo=True,
        valid=valid,
    )


def workload(profile: str, **overrides) -> WorkloadReport:
    fields = dict(
        profile=profile,
        prompt_tokens=512,
        output_tokens=128,
        context_tokens=640,
        slo_ttft_p99_ms=1000,
        slo_tpot_p99_ms=50,
        runs=[run()],
        ttft_p99_ms=400.0,
        tpot_p99_ms=40.0,
        max_concurrency_at_slo=8,
        output_tokens_per_s_at_slo=600,
        max_sessions_at_context=200,
        cost_per_1m_output_tokens=1.5,
    )
    fields.update(overrides)
    return WorkloadReport(**fields)


def load_report(*workloads: WorkloadReport, kv_bytes_per_token=4096) -> LoadTestReport:
    return LoadTestReport(
        endpoint="http://127.0.0.1:9000",
        gpu_hourly_usd=2.0,
        gpu_count=1,
        weights_bytes=10**9,
        kv_budget_bytes=8 * 2**30,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_cache_dtype="int8",
        workloads=list(workloads) or [workload(p) for p in LOAD_PROFILES],
    )


def by_key(outcomes) -> dict[tuple[str, str], object]:
    return {(o.gate, o.metric): o for o in outcomes}


def test_it_passes_complete_good_evidence_under_the_default_policy():
    outcomes = evaluate_policy(GatePolicy(), quality_report(), load_report(), True)

    assert all(o.outcome == "pass" for o in outcomes), [
        o for o in outcomes if o.outcome != "pass"
    ]
    keys = by_key(outcomes)
    assert ("quality:korean", "mean_kld") in keys
    assert ("load:rag-ko", "ttft_p99_ms") in keys
    assert evaluate_gates(outcomes).outcome == "pass"


def test_no_evidence_is_inconclusive_never_a_pass():
    outcomes = evaluate_policy(GatePolicy(), None, None, None)

    assert [o.outcome for o in outcomes] == ["inconclusive"] * 3
    assert all(o.reason.startswith("no ") for o in outcomes)
    decision = evaluate_gates(outcomes)
    assert (decision.ok, decision.outcome) == (False, "inconclusive")


def test_no_outcomes_at_all_is_inconclusive():
    decision = evaluate_gates([])

    assert (decision.ok, decision.outcome) == (False, "inconclusive")


def test_integrity_must_pass_whatever_the_policy():
    policy = GatePolicy(quality=None, load=None)

    [failed] = evaluate_policy(policy, None, None, False)
    [passed] = evaluate_policy(policy, None, None, True)

    assert (failed.gate, failed.outcome) == ("integrity", "fail")
    assert passed.outcome == "pass"


@pytest.mark.parametrize(
    ("field", "value", "metric", "observed"),
    [
        ("mean_kld", 0.11, "mean_kld", 0.11),  # int4 KV on SmolLM2 (REFERENCE.md)
        ("same_top1", 0.85, "same_top1", 0.85),
        ("ppl_ratio", 1.2, "ppl_ratio", 1.2),
        ("flips", 20, "flip_rate", 0.5),
        ("retrieval_ok", False, "retrieval", 0.0),
    ],
)
def test_it_fails_a_slice_over_a_threshold_and_says_by_how_much(
    field, value, metric, observed
):
    slices = [quality_slice(n) for n in QUALITY_SLICES if n != "long_context"]
    slices.append(quality_slice("long_context", **{field: value}))

    outcomes = by_key(
        evaluate_policy(GatePolicy(), quality_report(*slices), None, True)
    )

    failed = outcomes[("quality:long_context", metric)]
    assert failed.outcome == "fail"
    assert failed.observed == pytest.approx(observed)
    assert outcomes[
        ("quality:english", metric if metric != "retrieval" else "mean_kld")
    ]
    assert evaluate_gates(outcomes.values()).outcome == "fail"


def test_a_policy_chooses_the_grade():
    lossless = GatePolicy(
        quality=QualityPolicy(
            thresholds=SliceThresholds(max_mean_kld=0.002, min_same_top1=0.975)
        ),
        load=None,
    )

    outcomes = evaluate_policy(lossless, quality_report(), None, True)

    kld = by_key(outcomes)[("quality:code", "mean_kld")]
    assert (kld.outcome, kld.threshold) == ("fail", 0.002)
    assert "0.01 is not <= 0.002" in kld.reason


def test_per_slice_thresholds_replace_the_keys_they_name():
    policy = GatePolicy(
        quality=QualityPolicy(
            thresholds=SliceThresholds(min_same_top1=0.9),
            per_slice={
                "korean": SliceThresholds(max_mean_kld=0.005),
                "code": SliceThresholds(min_same_top1=None),
            },
        ),
        load=None,
    )

    outcomes = by_key(evaluate_policy(policy, quality_report(), None, True))

    assert outcomes[("quality:korean", "mean_kld")].outcome == "fail"
    assert outcomes[("quality:korean", "same_top1")].threshold == 0.9  # inherited
    assert ("quality:code", "same_top1") not in outcomes  # turned off by name
    assert outcomes[("quality:english", "mean_kld")].outcome == "pass"


def test_a_missing_slice_or_workload_is_inconclusive():
    report = quality_report(*(quality_slice(n) for n in ("english", "code")))
    load = load_report(workload("chat"))

    outcomes = by_key(evaluate_policy(GatePolicy(), report, load, True))

    assert outcomes[("quality:korean", "report")].outcome == "inconclusive"
    assert outcomes[("load:code-ko", "report")].outcome == "inconclusive"
    assert evaluate_gates(outcomes.values()).outcome == "inconclusive"


def test_no_tokens_and_an_interval_across_the_threshold_are_inconclusive():
    report = quality_report(
        quality_slice("english", num_tokens=0),
        quality_slice("code", mean_kld_ci95=Interval(low=0.02, high=0.04)),
    )
    policy = GatePolicy(quality=QualityPolicy(slices=["english"]), load=None)

    outcomes = by_key(evaluate_policy(policy, report, None, True))

    assert outcomes[("quality:english", "mean_kld")].outcome == "inconclusive"
    held = outcomes[("quality:code", "mean_kld")]
    assert held.outcome == "inconclusive"
    assert "too few tokens" in held.reason
    assert outcomes[("quality:code", "same_top1")].outcome == "pass"


def test_it_gates_latency_per_workload():
    policy = GatePolicy(
        quality=None,
        load=LoadPolicy(
            workloads=["chat", "rag"],
            per_workload={"rag": WorkloadThresholds(max_ttft_p99_ms=300)},
        ),
    )
    load = load_report(workload("chat", tpot_p99_ms=150.0), workload("rag"))

    outcomes = by_key(evaluate_policy(policy, None, load, True))

    assert outcomes[("load:chat", "tpot_p99_ms")].outcome == "fail"
    assert outcomes[("load:chat", "ttft_p99_ms")].outcome == "pass"
    rag = outcomes[("load:rag", "ttft_p99_ms")]
    assert (rag.outcome, rag.observed, rag.threshold) == ("fail", 400.0, 300)


def test_a_client_that_fell_behind_is_no_evidence():
    policy = GatePolicy(quality=None, load=LoadPolicy(workloads=["chat"]))
    load = load_report(workload("chat", runs=[run(valid=False)]))

    outcomes = evaluate_policy(policy, None, load, True)[1:]

    assert {o.outcome for o in outcomes} == {"inconclusive"}
    assert "fell behind" in outcomes[0].reason


def test_no_load_meeting_the_slo_is_judged_at_the_best_run_and_has_no_cost():
    policy = GatePolicy(
        quality=None,
        load=LoadPolicy(
            workloads=["chat"],
            thresholds=WorkloadThresholds(
                max_ttft_p99_ms=5000, max_cost_per_1m_output_tokens=3
            ),
        ),
    )
    chat = workload(
        "chat",
        runs=[run(ttft_p99=4000), run(ttft_p99=9000)],
        ttft_p99_ms=None,
        cost_per_1m_output_tokens=None,
    )

    outcomes = by_key(evaluate_policy(policy, None, load_report(chat), True))

    ttft = outcomes[("load:chat", "ttft_p99_ms")]
    assert (ttft.outcome, ttft.observed) == ("pass", 4000)
    assert "no load level met the SLO" in ttft.reason
    assert outcomes[("load:chat", "cost_per_1m_output_tokens")].outcome == "fail"


def test_it_gates_cost_per_million_tokens():
    policy = GatePolicy(
        quality=None,
        load=LoadPolicy(
            workloads=["chat"],
            thresholds=WorkloadThresholds(max_cost_per_1m_output_tokens=1.0),
        ),
    )

    outcomes = by_key(
        evaluate_policy(policy, None, load_report(workload("chat")), True)
    )
    cost = outcomes[("load:chat", "cost_per_1m_output_tokens")]

    assert (cost.metric, cost.outcome, cost.observed) == (
        "cost_per_1m_output_tokens",
        "fail",
        1.5,
    )


def test_it_gates_sessions_at_a_context_length():
    capacity = CapacityThreshold(min_sessions=64, context_tokens=32768)
    policy = GatePolicy(quality=None, load=LoadPolicy(workloads=[], capacity=capacity))
    # 8 GiB of KV at 4 KiB per token: 2M tokens, 64 sessions of 32k.
    roomy = load_report(workload("chat"), kv_bytes_per_token=4096)
    tight = load_report(workload("chat"), kv_bytes_per_token=8192)

    [*_, fits] = evaluate_policy(policy, None, roomy, True)
    [*_, short] = evaluate_policy(policy, None, tight, True)

    assert (fits.gate, fits.outcome, fits.observed) == ("capacity", "pass", 64)
    assert (short.outcome, short.observed) == ("fail", 32)


def test_a_workload_of_that_context_measures_sessions_itself():
    capacity = CapacityThreshold(min_sessions=100, context_tokens=640)
    policy = GatePolicy(quality=None, load=LoadPolicy(workloads=[], capacity=capacity))

    [*_, measured] = evaluate_policy(
        policy, None, load_report(workload("chat", max_sessions_at_context=90)), True
    )

    assert (measured.outcome, measured.observed) == ("fail", 90)
    assert "measured by a workload" in measured.reason


def test_the_policy_refuses_unknown_keys_and_bad_thresholds():
    with pytest.raises(ValidationError, match="max_kld"):
        GatePolicy.model_validate({"quality": {"thresholds": {"max_kld": 0.1}}})
    with pytest.raises(ValidationError, match="min_same_top1"):
        GatePolicy.model_validate({"quality": {"thresholds": {"min_same_top1": 2}}})
