"""evaluate_policy over evidence shaped as gpuagent.protocol fixes it."""

from decimal import Decimal

import pytest
from pydantic import ValidationError

from controlplane.costs.money import Pricing
from controlplane.releases.gates import (
    CapacityThreshold,
    GatePolicy,
    LiveBaseline,
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
    RoutingReport,
    SliceQuality,
    WorkloadReport,
)

DENSE = RoutingReport(status="not_applicable", reason="dense model: no routed experts")


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


def quality_report(
    *slices: SliceQuality, routing: RoutingReport | None = DENSE
) -> QualityReport:
    return QualityReport(
        candidate="llama@int4",
        reference="llama@bf16",
        method="in_process",
        seed=0,
        slices=list(slices) or [quality_slice(name) for name in QUALITY_SLICES],
        routing=routing,
    )


def pct(p99: float) -> Percentiles:
    return Percentiles(p50=p99 / 2, p90=p99 * 0.8, p95=p99 * 0.9, p99=p99)


# 2 USD per device-hour; the reports run on one device.
PRICED = Pricing("USD", Decimal("2.00"))
UNPRICED = Pricing("USD", Decimal(0))


def run(
    ttft_p99=400.0,
    tpot_p99=40.0,
    valid=True,
    *,
    concurrency=8,
    requests_per_s=3.0,
    output_tokens_per_s=600.0,
    goodput=3.0,
    hit_rate=None,
) -> LoadRun:
    return LoadRun(
        concurrency=concurrency,
        num_requests=100,
        num_errors=0,
        duration_s=30,
        ttft_ms=pct(ttft_p99),
        tpot_ms=pct(tpot_p99),
        itl_ms=pct(tpot_p99),
        e2e_ms=pct(5000),
        request_throughput=requests_per_s,
        output_tokens_per_s=output_tokens_per_s,
        goodput=goodput,
        meets_slo=True,
        valid=valid,
        prefix_cache_hit_rate=hit_rate,
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
    live = LiveBaseline("llama@0.9", load_report())

    outcomes = evaluate_policy(
        GatePolicy(), quality_report(), load_report(), True, live=live
    )

    # a dense model: the routing gate says it doesn't apply, everything else passes
    routing = [o for o in outcomes if o.gate == "routing"]
    assert [(o.outcome, o.metric) for o in routing] == [("skipped", "router")]
    assert all(o.outcome == "pass" for o in outcomes if o not in routing), [
        o for o in outcomes if o.outcome != "pass"
    ]
    keys = by_key(outcomes)
    assert ("quality:korean", "mean_kld") in keys
    assert ("load:rag-ko", "ttft_p99_ms") in keys
    assert ("load:rag-ko", "max_concurrency_at_slo") in keys
    assert ("load:rag-ko", "goodput") in keys
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
    live = LiveBaseline("llama@0.9", load_report(workload("chat")))

    outcomes = evaluate_policy(policy, None, load, True, live=live)[1:]

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
    # TPOT p99 150 ms: over the default 100, so no run meets the policy's SLO.
    chat = workload(
        "chat",
        runs=[run(ttft_p99=4000, tpot_p99=150), run(ttft_p99=9000, tpot_p99=150)],
        ttft_p99_ms=None,
        cost_per_1m_output_tokens=None,
    )

    outcomes = by_key(
        evaluate_policy(policy, None, load_report(chat), True, pricing=PRICED)
    )

    ttft = outcomes[("load:chat", "ttft_p99_ms")]
    assert (ttft.outcome, ttft.observed) == ("pass", 4000)
    assert "no load level met the SLO" in ttft.reason
    assert outcomes[("load:chat", "cost_per_1m_output_tokens")].outcome == "fail"


def _cost_policy(**thresholds) -> GatePolicy:
    return GatePolicy(
        quality=None,
        load=LoadPolicy(
            workloads=["chat"], thresholds=WorkloadThresholds(**thresholds)
        ),
    )


@pytest.mark.parametrize(
    ("limit", "pricing", "outcome", "observed"),
    [(0.93, PRICED, "pass", 0.925926), (0.92, PRICED, "fail", 0.925926)]
    + [(0.93, UNPRICED, "inconclusive", None)],
)
def test_it_gates_cost_per_million_tokens_priced_by_the_environment(
    limit, pricing, outcome, observed
):
    """2 USD per device-hour on one device at 600 output tokens/s: 600 x 3600 =
    2,160,000 tokens an hour, so 1M cost 2 / 2.16 = 0.9259259... USD, 0.925926 at
    six decimals. The report's own cost_per_1m_output_tokens (1.5) is ignored; a
    device-hour at 0 is no evidence."""
    policy = _cost_policy(max_cost_per_1m_output_tokens=limit)

    outcomes = by_key(
        evaluate_policy(
            policy, None, load_report(workload("chat")), True, pricing=pricing
        )
    )
    cost = outcomes[("load:chat", "cost_per_1m_output_tokens")]

    assert (cost.outcome, cost.observed) == (outcome, observed)


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


# -- against the release live in the environment ---------------------------------------


def sweep(knee, *, goodput=3.0, output_tokens_per_s=600.0, hit_rate=None):
    """A closed-loop sweep at 4, 8, 16, 32 whose runs up to `knee` meet the
    default SLO (TPOT p99 40 ms) and the others miss it (400 ms)."""
    return [
        run(
            tpot_p99=40.0 if level <= knee else 400.0,
            concurrency=level,
            requests_per_s=level / 4,
            output_tokens_per_s=output_tokens_per_s * level / 8,
            goodput=goodput if level <= knee else 0.0,
            hit_rate=hit_rate,
        )
        for level in (4, 8, 16, 32)
    ]


def chat_with(**options) -> LoadTestReport:
    return load_report(workload("chat", runs=sweep(**options)))


def test_the_first_release_of_an_environment_says_it_has_no_baseline():
    policy = GatePolicy(quality=None, load=LoadPolicy(workloads=["chat"]))

    outcomes = evaluate_policy(policy, None, chat_with(knee=16), True)

    [baseline] = [o for o in outcomes if o.gate == "live"]
    assert (baseline.metric, baseline.outcome) == ("baseline", "skipped")
    assert "nothing is live" in baseline.reason
    assert not any(o.metric == "max_concurrency_at_slo" for o in outcomes)
    decision = evaluate_gates(outcomes)
    assert (decision.outcome, decision.ok) == ("pass", True)
    assert "1 skipped" in decision.reason


def test_only_skipped_checks_are_no_pass():
    skipped = evaluate_policy(
        GatePolicy(quality=None, load=LoadPolicy(workloads=["chat"])),
        None,
        chat_with(knee=16),
        True,
    )[-3:]

    assert {o.outcome for o in skipped} >= {"skipped"}
    only_skipped = [o for o in skipped if o.outcome == "skipped"]
    assert evaluate_gates(only_skipped).outcome == "inconclusive"


def test_a_live_release_without_a_load_test_is_no_baseline():
    policy = GatePolicy(quality=None, load=LoadPolicy(workloads=["chat"]))
    live = LiveBaseline("llama@0.9", None, problem="load_test job 7 unreadable")

    outcomes = evaluate_policy(policy, None, chat_with(knee=16), True, live=live)

    [baseline] = [o for o in outcomes if o.gate == "live"]
    assert baseline.outcome == "inconclusive"
    assert "llama@0.9 has no load test" in baseline.reason
    assert "load_test job 7 unreadable" in baseline.reason


@pytest.mark.parametrize(
    ("mine", "theirs", "outcome", "threshold"),
    [
        (16, 16, "pass", 14.4),  # 16 x (1 - 10%)
        (8, 16, "fail", 14.4),  # -50%
        (16, 4, "pass", 3.6),
    ],
)
def test_max_concurrency_at_the_slo_may_not_drop_more_than_the_policy_allows(
    mine, theirs, outcome, threshold
):
    policy = GatePolicy(quality=None, load=LoadPolicy(workloads=["chat"]))
    live = LiveBaseline("llama@0.9", chat_with(knee=theirs))

    outcomes = by_key(
        evaluate_policy(policy, None, chat_with(knee=mine), True, live=live)
    )

    knee = outcomes[("load:chat", "max_concurrency_at_slo")]
    assert (knee.outcome, knee.observed) == (outcome, mine)
    assert knee.threshold == pytest.approx(threshold)


def test_the_knee_follows_the_policys_slo_not_the_load_tests():
    """Runs up to 16 have TPOT p99 40 ms, beyond 400: under a 500 ms TPOT
    threshold every level meets the SLO, so the knee is 32 on both sides."""
    policy = _cost_policy(max_tpot_p99_ms=500)
    live = LiveBaseline("llama@0.9", chat_with(knee=32))

    outcomes = by_key(
        evaluate_policy(policy, None, chat_with(knee=16), True, live=live)
    )

    knee = outcomes[("load:chat", "max_concurrency_at_slo")]
    assert (knee.outcome, knee.observed) == ("pass", 32)


@pytest.mark.parametrize(
    ("mine", "theirs", "outcome"),
    [(3.0, 3.2, "pass"), (2.0, 3.2, "fail")],  # -6.25% / -37.5% vs 10%
)
def test_goodput_may_not_drop_more_than_the_policy_allows(mine, theirs, outcome):
    policy = GatePolicy(quality=None, load=LoadPolicy(workloads=["chat"]))
    live = LiveBaseline("llama@0.9", chat_with(knee=16, goodput=theirs))

    outcomes = by_key(
        evaluate_policy(policy, None, chat_with(knee=16, goodput=mine), True, live=live)
    )

    goodput = outcomes[("load:chat", "goodput")]
    assert (goodput.outcome, goodput.observed) == (outcome, mine)
    assert goodput.threshold == pytest.approx(theirs * 0.9)


def test_capacity_without_evidence_on_either_side_is_inconclusive():
    policy = GatePolicy(quality=None, load=LoadPolicy(workloads=["chat"]))
    behind = load_report(workload("chat", runs=[run(valid=False)]))
    other = load_report(workload("code"))

    fell_behind = by_key(
        evaluate_policy(
            policy,
            None,
            behind,
            True,
            live=LiveBaseline("llama@0.9", chat_with(knee=16)),
        )
    )
    not_measured_live = by_key(
        evaluate_policy(
            policy,
            None,
            chat_with(knee=16),
            True,
            live=LiveBaseline("llama@0.9", other),
        )
    )

    assert fell_behind[("load:chat", "max_concurrency_at_slo")].outcome == (
        "inconclusive"
    )
    assert fell_behind[("load:chat", "goodput")].outcome == "inconclusive"
    versus = not_measured_live[("load:chat", "versus_live")]
    assert versus.outcome == "inconclusive"
    assert "llama@0.9 did not measure 'chat'" in versus.reason


@pytest.mark.parametrize(
    ("mine", "pricing", "outcome"),
    [(600.0, PRICED, "pass"), (400.0, PRICED, "fail"), (600.0, UNPRICED, None)],
)
def test_cost_per_million_tokens_may_rise_at_most_the_policys_share_over_live(
    mine, pricing, outcome
):
    """Both operating points are at concurrency 16 (2x the output rate given at 8).
    Live makes 1,200 output tokens/s: 2 USD / (1,200 x 3,600) x 1e6 = 0.462963 USD
    per 1M; +20% allows 0.5555556. The candidate at 1,200 costs the same (pass);
    at 800 tokens/s it costs 2 / 2.88 = 0.694444 (+50%: fail)."""
    policy = _cost_policy(max_cost_increase_pct=20)
    live = LiveBaseline("llama@0.9", chat_with(knee=16))

    outcomes = by_key(
        evaluate_policy(
            policy,
            None,
            chat_with(knee=16, output_tokens_per_s=mine),
            True,
            live=live,
            pricing=pricing,
        )
    )

    cost = outcomes[("load:chat", "cost_per_1m_output_tokens_vs_live")]
    if outcome is None:
        assert cost.outcome == "inconclusive"
        assert "costs 0 USD" in cost.reason
        return
    assert cost.outcome == outcome
    assert cost.threshold == pytest.approx(0.462963 * 1.2)
    assert cost.observed == (0.462963 if outcome == "pass" else 0.694444)


@pytest.mark.parametrize(
    ("hit_rate", "outcome"),
    [(0.8, "pass"), (0.4, "fail"), (None, "inconclusive")],
)
def test_session_workloads_need_the_policys_prefix_cache_hit_rate(hit_rate, outcome):
    policy = GatePolicy(
        quality=None,
        load=LoadPolicy(
            workloads=["chat"],
            per_workload={"chat": WorkloadThresholds(min_prefix_cache_hit_rate=0.6)},
        ),
    )
    report = chat_with(knee=16, hit_rate=hit_rate)

    outcomes = by_key(evaluate_policy(policy, None, report, True))

    hits = outcomes[("load:chat", "prefix_cache_hit_rate")]
    assert (hits.outcome, hits.observed, hits.threshold) == (outcome, hit_rate, 0.6)
    if hit_rate is None:
        assert "reported no prefix-cache hit rate" in hits.reason
