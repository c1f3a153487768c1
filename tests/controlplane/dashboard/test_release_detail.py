import json
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from controlplane.releases.actions.gate_policies import do_update_gate_policy
from controlplane.releases.actions.gate_results import do_evaluate_release_gates
from controlplane.releases.actions.jobs import do_finish_job, do_start_job
from controlplane.releases.actions.manifests import do_record_manifest
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Job
from gpuagent.protocol import FileDigest, ServingEngine, default_load_plan
from tests.controlplane.dashboard.builders import (
    compress_result,
    load_test_report,
    moe_routing,
    quality_report,
    record_job,
    set_price,
)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _chart(response, name: str) -> dict:
    body = response if isinstance(response, str) else response.content.decode()
    start = body.index(f'id="chart-data-{name}" type="application/json">')
    start = body.index(">", start) + 1
    return json.loads(body[start : body.index("</script>", start)])


PERFORMANCE = ("memory", "ttft", "tpot", "context", "goodput", "reuse", "kv_bytes")
WORKLOAD_CURVES = ("load-0", "load-1", "load-2")


def test_it_shows_the_evidence_of_a_candidate(
    client, owner, teammate, awaiting, environment
):
    set_price(environment, owner)
    release = awaiting("1.0.0")
    load = load_test_report(release.recipe)
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    body = response.content.decode()
    assert response.status_code == 200
    assert response.context["evidence"].load == load
    for name in (*PERFORMANCE, "kv_sessions", *WORKLOAD_CURVES):
        assert _chart(response, name)["data"], name
    for name in ("quality_kld", "quality_top1", "cost", "timeline"):
        assert _chart(response, name)["data"], name
    memory = _chart(response, "memory")
    assert memory["data"][0]["y"] == [load.weights_bytes / 2**30]
    assert "english.mean_kld" in body
    for artifact in release.artifacts.all():
        assert artifact.digest in body
    assert "ci-signing@acme.example" in body
    assert "verified</span> by its verify job" in body


def test_it_puts_the_evidence_before_the_decision(client, teammate, awaiting):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    positions = [
        body.index(marker)
        for marker in (
            'id="stages"',
            'id="gates"',
            'id="chart-memory"',
            'id="quality"',
            'id="artifacts"',
            "<h2>Compared with live</h2>",
            'id="history"',
            'class="decision"',
        )
    ]
    assert positions == sorted(positions)


def test_it_shows_the_share_of_checks_in_the_time_to_deploy(client, teammate, awaiting):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    overhead = response.context["overhead"]
    assert 0 < overhead.integrity_s < overhead.time_to_deploy_s
    assert 0 < overhead.tests_s < overhead.time_to_deploy_s
    assert not overhead.deployed
    assert b"Pipeline time so far" in response.content
    stages = [stage.kind for stage in response.context["stages"]]
    assert stages[:2] == ["verify_source", "compress"]


def test_it_offers_the_decision_on_the_full_digest_to_an_approver(
    client, teammate, awaiting
):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    body = response.content.decode()
    assert response.context["decision_refusal"] == ""
    assert (
        f'<code class="digest" id="decision-digest">{release.manifest_digest}' in body
    )
    assert f'action="/releases/{release.pk}/approve/"' in body
    assert f'action="/releases/{release.pk}/reject/"' in body
    assert 'name="comment" maxlength="2000" required' in body


def test_it_tells_the_registrant_why_they_cannot_approve(client, owner, awaiting):
    release = awaiting("1.0.0")
    client.force_login(owner)

    response = client.get(f"/releases/{release.pk}/")

    assert b"/approve/" not in response.content
    assert (
        f"alice registered {release} and cannot also approve it".encode()
        in response.content
    )


def test_it_tells_a_member_why_they_cannot_approve(client, member, awaiting):
    release = awaiting("1.0.0")
    client.force_login(member)

    response = client.get(f"/releases/{release.pk}/")

    assert b"/approve/" not in response.content
    assert b"needs role approver or admin in team acme, has member" in response.content


def test_it_flags_a_candidate_with_the_live_digest(
    client, teammate, make_live, make_release, agent
):
    live = make_live("0.9.0")
    again = make_release("0.9.1")
    do_record_manifest(
        again,
        manifest_digest=live.manifest_digest,
        files=[
            FileDigest(path=a.path, size_bytes=a.size_bytes, digest=a.digest)
            for a in live.artifacts.all()
        ],
    )
    client.force_login(teammate)

    response = client.get(f"/releases/{again.pk}/")

    assert response.context["evidence"].comparison.same_digest is True
    assert b'id="same-as-live"' in response.content


def test_it_shows_what_differs_from_live(client, teammate, make_live, awaiting):
    live = make_live("0.9.0", speed=0.8)
    candidate = awaiting("1.0.0", speed=1.3)
    client.force_login(teammate)

    response = client.get(f"/releases/{candidate.pk}/")

    comparison = response.context["evidence"].comparison
    assert comparison.live == live and comparison.same_digest is False
    differing = {d.what for d in comparison.differences}
    assert {"version", "manifest digest", "chat: TTFT p99 at SLO (ms)"} <= differing
    assert "weights" not in differing  # same recipe
    assert comparison.files_changed == sorted(a.path for a in live.artifacts.all())
    assert f"live {live.version}" in _chart(response, "memory")["data"][0]["x"]


def test_it_says_what_evidence_is_missing(client, teammate, release):
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    assert b"No load test recorded for this release" in response.content
    assert b"No quality regression recorded for this release" in response.content
    assert b"without evidence there is nothing to pass" in response.content
    assert response.context["evidence"].charts == {}


def test_it_shows_the_gate_policy_outcomes_with_missing_evidence(
    client, teammate, release
):
    # The environment's (default) policy over a quality report and no load test:
    # the quality checks are judged, the load gate is inconclusive, not a pass.
    do_evaluate_release_gates(
        release, quality=quality_report(release), load=None, integrity_ok=True
    )
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    rows = {(g.gate, g.metric): g for g in response.context["gate_results"]}
    assert rows[("quality:english", "mean_kld")].outcome == "pass"
    assert rows[("load", "report")].outcome == "inconclusive"
    body = response.content.decode()
    assert "<td>quality:english</td><td>mean_kld</td>" in body
    load_row = re.search(r"<td>load</td><td>report</td>(.*?)</tr>", body, re.S)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", load_row.group(1), re.S)
    assert [c.strip() for c in cells] == [
        "—",
        "—",
        '<span class="state state-inconclusive">inconclusive</span>',
        "no evidence: the load-test job produced no report",
    ]


def test_it_compares_a_moe_releases_routing_with_live(
    client, teammate, make_live, awaiting
):
    make_live("0.9.0", routing=moe_routing(0.93, 0.88))
    candidate = awaiting("1.0.0", routing=moe_routing(0.9, 0.72, shift=0.02))
    client.force_login(teammate)

    response = client.get(f"/releases/{candidate.pk}/")

    differing = {d.what: d for d in response.context["evidence"].comparison.differences}
    agreement = differing["router agreement vs its reference (worst MoE layer)"]
    assert (agreement.candidate, agreement.live) == ("0.72", "0.88")
    shift = differing["expert-load shift vs its reference (worst MoE layer)"]
    assert (shift.candidate, shift.live) == ("0.04", "0.02")


def _routing_rows(body: str) -> dict[str, list[str]]:
    table = re.search(r'<table id="routing">(.*?)</table>', body, re.S).group(1)
    rows = re.findall(r'<tr data-layer="(\d+)">(.*?)</tr>', table, re.S)
    return {
        layer: [
            re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", c)).strip()
            for c in re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)
        ]
        for layer, cells in rows
    }


def test_it_shows_a_moe_releases_routing_per_layer_against_the_policy(
    client, owner, teammate, awaiting, environment
):
    do_update_gate_policy(
        environment,
        {"quality": {"routing": {"min_router_agreement": 0.9}}},
        actor=owner,
    )
    release = awaiting("2.0.0", routing=moe_routing(0.95, 0.71, 0.92))
    do_evaluate_release_gates(
        release,
        quality=quality_report(release, routing=moe_routing(0.95, 0.71, 0.92)),
        load=None,
        integrity_ok=True,
    )
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    rows = _routing_rows(body)
    assert rows["1"] == [
        "1",
        "4096",
        "95.0% [93.0%, 97.0%]",
        "0.9900",
        "0.01",
        "0.1 (expert 8)",
    ]
    assert rows["2"][2] == "71.0% [69.0%, 73.0%]" and rows["3"][4] == "0.03"
    # the layer under the policy's 90% is marked, the others not
    table = re.search(r'<table id="routing">(.*?)</table>', body, re.S).group(1)
    assert table.count("state-fail") == 1
    assert re.search(r'data-layer="2">.*?state-fail">71.0%', table, re.S)
    worst = re.search(r'<p id="routing-worst">(.*?)</p>', body, re.S).group(1)
    assert "<strong>71.0%</strong> (layer 2)" in worst
    assert "agreement &ge; 90.0%" in body
    gate = re.search(
        r"<td>routing</td><td>router_agreement</td>(.*?)</tr>", body, re.S
    ).group(1)
    assert "state-fail" in gate and "layer 2" in gate


@pytest.mark.parametrize(
    ("routing", "says"),
    [
        (None, "The quality report has no routing evidence"),
        ("dense", "Not applicable: dense model: no routed experts."),
    ],
)
def test_it_says_when_routing_does_not_apply_or_is_missing(
    client, teammate, awaiting, routing, says
):
    options = {} if routing == "dense" else {"routing": None}
    release = awaiting("3.0.0", **options)
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    assert says in body
    assert '<table id="routing">' not in body


def test_it_shows_an_unreadable_report_as_a_problem(client, teammate, release):
    job = do_start_job(release, "load_test")
    do_finish_job(job, result={"endpoint": "http://x"})
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    assert response.status_code == 200
    assert f"load_test job {job.pk} recorded an unreadable report".encode() in (
        response.content
    )
    assert response.context["evidence"].load is None


def _compression(body: str) -> str:
    return re.search(
        r'<table class="facts" id="compression">(.*?)</table>\s*</div>', body, re.S
    ).group(1)


def test_it_shows_a_moe_releases_active_parameters_and_rtn_fallbacks(
    client, teammate, awaiting
):
    release = awaiting("2.0.0", routing=moe_routing(0.95, 0.92))
    made = compress_result(
        release,
        parameters=(1_140_000, 420_000),
        fallbacks=((2, 5, 3), (3, 7, 0)),
        min_expert_tokens=16,
    )
    record_job(release, "compress", made.model_dump(mode="json"))
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    body = response.content.decode()
    assert response.context["evidence"].compression == made
    table = _compression(body)
    parameters = re.search(
        r'id="compression-parameters">(.*?)</td>', table, re.S
    ).group(1)
    assert "<strong>1140000</strong> in total" in parameters
    assert "<strong>420000</strong> active per token" in parameters
    assert "(36.8% of the total)" in parameters
    fallbacks = re.search(r'id="compression-fallbacks">(.*?)</td>\s*</tr>', table, re.S)
    assert "2 routed experts got fewer than 16 calibration tokens" in fallbacks.group(1)
    rows = re.findall(
        r'<tr data-layer="(\d+)" data-expert="(\d+)"><td class="num">\d+</td>'
        r'<td class="num">\d+</td><td class="num">(\d+)</td></tr>',
        table,
    )
    assert rows == [("2", "5", "3"), ("3", "7", "0")]


@pytest.mark.parametrize(
    ("min_expert_tokens", "says"),
    [
        (16, "none: every routed expert got at least 16 calibration tokens"),
        (None, "not applicable: the recipe's weights are not calibrated"),
    ],
)
def test_it_says_when_no_expert_fell_back(
    client, teammate, awaiting, min_expert_tokens, says
):
    release = awaiting("2.0.0")
    made = compress_result(
        release, parameters=(1_000, 500), min_expert_tokens=min_expert_tokens
    )
    record_job(release, "compress", made.model_dump(mode="json"))
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    assert says in _compression(body)
    assert 'id="rtn-fallbacks"' not in body


def test_it_shows_no_moe_facts_for_a_dense_release(client, teammate, awaiting):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    table = _compression(body)
    assert 'id="compression-size"' in table
    assert "compression-parameters" not in table
    assert "compression-fallbacks" not in table


def test_it_shows_an_unreadable_compress_report_as_a_problem(client, teammate, release):
    job = do_finish_job(do_start_job(release, "compress"), result={"candidate": 3})
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    assert f"compress job {job.pk} recorded an unreadable report".encode() in (
        response.content
    )
    assert response.context["evidence"].compression is None
    assert b"No compress report: no compress job has succeeded" in response.content


def test_it_shows_the_audit_trail_of_release_jobs_and_deployments(
    client, teammate, make_live
):
    live = make_live("0.9.0")
    client.force_login(teammate)

    response = client.get(f"/releases/{live.pk}/")

    verbs = [event.verb for event in response.context["history"]]
    assert verbs[0] == "release.registered"
    assert {"job.succeeded", "deployment.started", "deployment.live"} <= set(verbs)
    assert verbs.count("release.approved") == 1


def test_it_shows_the_failure_reason(client, owner, release):
    do_transition_release(release, "failed", actor=owner, reason="disk full")
    client.force_login(owner)

    response = client.get(f"/releases/{release.pk}/")

    assert b"<strong>Reason:</strong> disk full" in response.content


def test_it_is_404_for_outsiders(client, outsider, awaiting):
    release = awaiting("1.0.0")
    client.force_login(outsider)

    response = client.get(f"/releases/{release.pk}/")

    assert response.status_code == 404
    assert release.manifest_digest.encode() not in response.content


def test_it_is_404_for_missing_releases(client, owner, db):
    client.force_login(owner)

    assert client.get("/releases/999999/").status_code == 404


def test_it_says_a_live_release_is_not_for_deciding(client, teammate, make_live):
    release = make_live("0.9.0")
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    assert response.context["decision_refusal"] == (
        "it is live; a person decides on a release awaiting approval"
    )
    assert b"/approve/" not in response.content


def _stage_row(body: str, kind: str) -> str:
    return re.search(rf'<tr data-stage="{kind}">(.*?)</tr>', body, re.S).group(1)


def _record(release, kind, result, *, error="", at_s=None, took_s=None):
    job = do_finish_job(do_start_job(release, kind), result=result, error=error)
    if at_s is not None:
        started = T0 + timedelta(seconds=at_s)
        Job.objects.filter(pk=job.pk).update(
            started=started, finished=started + timedelta(seconds=took_s)
        )
    return job


def test_it_shows_a_stage_that_did_no_work_as_skipped_with_why(
    client, teammate, release
):
    _record(release, "compress", {"skipped": "compressor not built yet"})
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    row = _stage_row(body, "compress")
    assert 'data-outcome="skipped"' in row
    assert "compressor not built yet" in row
    assert "state-succeeded" not in row
    timeline = _chart(body, "timeline")["data"][0]
    assert timeline["customdata"][0].endswith(", skipped")
    assert timeline["marker"]["color"][0] != "#2e7d32"  # not the green of success


@pytest.mark.parametrize(
    ("quality", "load", "outcome", "reason"),
    [
        (0.5, "report", "fail", "failed gates: "),  # KLD far over the threshold
        (0.004, None, "inconclusive", "inconclusive gates: load (report)"),
    ],
)
def test_it_shows_the_gate_stage_as_its_gate_results_say(
    client, teammate, release, quality, load, outcome, reason
):
    do_evaluate_release_gates(
        release,
        quality=quality_report(release, kld=quality),
        load=load_test_report(release.recipe) if load else None,
        integrity_ok=True,
    )
    # The gate job itself succeeds: it got as far as deciding.
    _record(release, "gate", {})
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    row = _stage_row(body, "gate")
    assert f'data-outcome="{outcome}"' in row
    assert reason in row
    assert "state-succeeded" not in row


def test_it_shows_each_stage_duration_and_the_checks_share(client, teammate, release):
    _record(release, "verify_source", {"ok": True}, at_s=0, took_s=10)
    _record(release, "compress", {}, at_s=10, took_s=50)
    _record(release, "sign", {}, at_s=60, took_s=10)
    _record(release, "evaluate", {}, at_s=70, took_s=30)
    _record(release, "load_test", {}, at_s=70, took_s=40)
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    durations = {
        kind: re.findall(r'<td class="num">(.*?)</td>', _stage_row(body, kind))[0]
        for kind in ("verify_source", "compress", "sign", "evaluate", "load_test")
    }
    assert durations == {
        "verify_source": "10.0 s",
        "compress": "50.0 s",
        "sign": "10.0 s",
        "evaluate": "30.0 s",
        "load_test": "40.0 s",
    }
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", body))
    # 110 s on the way to deploy; integrity 20 s of it, tests (in parallel) 40 s.
    assert "Pipeline time so far: 110.0 s of machine time" in text
    assert "Integrity checks added 20.0 s (18.2%)" in text
    assert "quality and load tests 40.0 s (36.4%)" in text


def test_it_draws_candidate_and_live_on_the_same_axes_with_the_policys_slo(
    client, owner, teammate, make_live, awaiting, environment
):
    set_price(environment, owner)
    do_update_gate_policy(
        environment,
        {"load": {"per_workload": {"chat": {"max_tpot_p99_ms": 45}}}},
        actor=owner,
    )
    live = make_live("0.9.0", speed=0.8)
    candidate = awaiting("1.0.0", speed=1.3)
    client.force_login(teammate)

    response = client.get(f"/releases/{candidate.pk}/")

    assert _chart(response, "memory")["data"][0]["x"][-1] == f"live {live.version}"
    for name in ("context", "goodput", "reuse", "cost", *WORKLOAD_CURVES):
        names = " ".join(t["name"] for t in _chart(response, name)["data"])
        assert f"candidate {candidate.version}" in names, name
        assert f"live {live.version}" in names, name
    chat = _chart(response, "load-0")
    assert chat["layout"]["title"]["text"].startswith("chat:")
    slo = {
        t["yaxis"]: t["y"][0] for t in chat["data"] if t["name"] == "SLO (gate policy)"
    }
    assert slo == {"y2": 2000, "y3": 45}
    tpot = _chart(response, "tpot")["data"][-1]
    assert tpot["y"][tpot["x"].index("chat")] == 45


def test_it_plans_capacity_against_live_for_the_environments_traffic(
    client, owner, teammate, make_live, awaiting, environment
):
    set_price(environment, owner, target_requests_per_s={"chat": 40.0, "rag": 4.0})
    live = make_live("0.9.0", speed=0.8)
    candidate = awaiting("1.0.0", speed=1.3)
    client.force_login(teammate)

    response = client.get(f"/releases/{candidate.pk}/")
    typed = client.get(f"/releases/{candidate.pk}/?targets=code:2")
    bad = client.get(f"/releases/{candidate.pk}/?targets=code:fast")

    costs = response.context["evidence"].costs
    assert [row.workload for row in costs.plan.rows] == ["chat", "rag"]
    chat = costs.plan.rows[0]
    assert chat.live is not None and chat.candidate.devices < chat.live.devices
    body = response.content.decode()
    assert 'id="capacity"' in body
    assert f"Live {live.version}" in body
    assert f"{chat.device_difference:+d}" in body
    assert "all (one shared pool)" in body
    assert [r.workload for r in typed.context["evidence"].costs.plan.rows] == ["code"]
    assert b"The target traffic typed above" in typed.content
    assert bad.status_code == 400
    assert "'fast' is not a number" in bad.context["targets_error"]
    assert b'id="targets-error"' in bad.content


def test_it_warns_when_the_environment_has_no_price(client, teammate, awaiting):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    body = response.content.decode()
    assert "No device price is set for acme/staging" in body
    assert 'id="no-targets"' in body
    assert "0.000000" not in body
    assert "cost" not in response.context["evidence"].charts


def test_it_prices_the_agent_time_of_the_verification(
    client, owner, teammate, awaiting, environment
):
    set_price(environment, owner, "7200")  # 2 USD per device-second
    release = awaiting("1.0.0")
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    parts = {
        part.what: part
        for part in response.context["evidence"].costs.verification.parts
    }
    load_test = release.jobs.get(kind="load_test")
    assert parts["load"].seconds == load_test.duration_s
    assert parts["load"].cost == (2 * Decimal(repr(load_test.duration_s))).quantize(
        Decimal("0.000001")
    )
    assert 'id="verification"' in response.content.decode()


def test_it_says_which_points_the_load_plan_left_out(client, teammate, awaiting):
    release = awaiting("1.0.0")
    report = load_test_report(release.recipe).model_copy(
        update={
            "plan": default_load_plan(),
            "budget_s": 80.0,
            "wall_s": 79.6,
            "skipped_for_budget": ["rag c=8", "code-ko 2/s"],
            "unmeasured": ["rag 4096 tok: over the server's max_model_len"],
        }
    )
    Job.objects.filter(release=release, kind="load_test").update(
        result=report.model_dump(mode="json")
    )
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    assert "6 workloads within a budget of 80 s; ran 79.6 s." in body
    assert "Skipped for the budget: rag c=8, code-ko 2/s." in body
    assert "rag 4096 tok: over the server&#x27;s max_model_len" in body


def test_it_names_the_engines_that_measured_the_evidence(client, teammate, awaiting):
    release = awaiting("1.0.0")
    vllm = ServingEngine(
        name="vllm",
        version="0.33.0",
        backend="external",
        command=["vllm", "serve", "/m", "--api-key", "***", "--kv-cache-dtype", "fp8"],
    )
    parent = vllm.model_copy(update={"command": ["vllm", "serve", "/parent"]})
    quality = quality_report(release)
    quality = quality.model_copy(
        update={
            "method": "http_top_n",
            "top_n": 20,
            "candidate_engine": vllm,
            "reference_engine": parent,
            "servers": "one_after_other",
            "slices": [
                s.model_copy(
                    update={
                        "mean_kld_lower": 0.00321,
                        "tail_mass_mean": 0.0374,
                        "tail_mass_max": 0.41,
                    }
                )
                for s in quality.slices
            ],
        }
    )
    load = load_test_report(release.recipe).model_copy(update={"engine": vllm})
    for kind, report in (("evaluate", quality), ("load_test", load)):
        Job.objects.filter(release=release, kind=kind).update(
            result=report.model_dump(mode="json")
        )
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    engines = body[body.index('id="quality-engines"') :]
    assert "run one after the other" in engines
    assert "candidate: <strong>vllm 0.33.0</strong> (external backend)" in engines
    assert "vllm serve /m --api-key *** --kv-cache-dtype fp8" in engines
    assert "reference: <strong>vllm 0.33.0</strong>" in engines
    assert "vllm serve /parent" in engines
    assert "0.0374 / 0.4100" in body  # the tail mass beside the KL
    assert '<td class="num">0.0032</td>' in body  # and the lower bound
    assert "which is a lower bound of the true KL" in body
    load_engine = body[body.index('id="load-engine"') :]
    assert "Served by <strong>vllm 0.33.0</strong>" in load_engine


def test_it_says_in_process_evidence_came_from_the_agents_engine(
    client, teammate, awaiting
):
    release = awaiting("1.0.0")
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()

    assert "Measured in the agent's process by the project's engine" in body
    assert "Tail mass" not in body
    assert 'id="load-engine"' not in body


def test_it_shows_the_recipes_head_beside_the_weights(client, teammate, make_release):
    recipe = {"weights": "w4a16-g128", "kv_cache_dtype": "int8", "head": "int8"}
    release = make_release("2.0.0", recipe=recipe)
    plain = make_release("2.0.1")
    for made in (release, plain):
        record_job(made, "compress", compress_result(made).model_dump(mode="json"))
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/").content.decode()
    plain_body = client.get(f"/releases/{plain.pk}/").content.decode()

    summary = re.search(r'id="summary">(.*?)</table>', body, re.S).group(1)
    assert "weights w4a16-g128, KV cache int8, head int8</td>" in summary
    assert ", head int8</td>" in _compression(body)
    assert "head" not in re.search(r"<th>Recipe</th><td>(.*?)</td>", plain_body).group(
        1
    )
    assert "head" not in _compression(plain_body)
