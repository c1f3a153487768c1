"""Decisions that race with what changes meanwhile: a digest quarantined while its
deploy runs, a re-verification answered after its copy stopped being live, and a
gate policy (or the cost model its cost checks price with) changed between the
gate and the approval. The agent's answers come
through conftest.LocalAgent."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.costs.actions import do_set_cost_model, do_update_cost_model
from controlplane.errors import GatesNoLongerPass
from controlplane.fleet.models import Deployment
from controlplane.releases.actions.approvals import do_approve_release
from controlplane.releases.actions.deployments import (
    do_complete_deployment,
    do_start_deployment,
)
from controlplane.releases.actions.gate_policies import (
    do_set_gate_policy,
    do_update_gate_policy,
)
from controlplane.releases.actions.gate_results import do_evaluate_release_gates
from controlplane.releases.actions.jobs import do_dispatch_job, do_finish_job
from controlplane.releases.actions.rollbacks import (
    do_rollback_environment,
    previous_verified_deployment,
)
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.evidence import integrity_ok
from controlplane.releases.models import EnvironmentGatePolicy, Job, Release
from controlplane.releases.tasks import run_deployment, run_reverification
from gpuagent.protocol import DeployResult, VerifyResult
from tests.controlplane.releases.test_evaluate_policy import load_report, quality_report

DIGEST = "sha256:" + "d" * 64


def state(release) -> str:
    return Release.objects.get(pk=release.pk).state


# -- a digest quarantined while its deploy runs ---------------------------------------


def test_a_digest_quarantined_after_the_deploy_was_sent_never_goes_live(
    make_release, local_agent, owner
):
    twin = make_release(state="superseded", manifest_digest=DIGEST)
    release = make_release(state="approved", manifest_digest=DIGEST)
    run_deployment(release.pk)
    (_, request), *_ = local_agent.pending("deploy")
    assert request.quarantined_digests == []  # trusted when it was sent
    do_transition_release(twin, "quarantined", actor=owner, reason="copy changed")

    local_agent.answer(
        "deploy",
        DeployResult(ok=True, endpoint="http://a:8000", deployment_id="srv-1"),
    )

    deployment = Deployment.objects.get(release=release)
    assert (deployment.state, state(release)) == ("failed", "failed")
    assert f"digest {DIGEST} became untrusted" in deployment.reason
    assert str(twin) in Release.objects.get(pk=release.pk).failure_reason
    (_, undeploy), *_ = local_agent.pending("undeploy")
    assert (undeploy.deployment_id, undeploy.serving_id) == (deployment.pk, "srv-1")


def test_a_digest_still_trusted_goes_live(make_release, local_agent):
    make_release(state="superseded", manifest_digest=DIGEST)
    release = make_release(state="approved", manifest_digest=DIGEST)
    run_deployment(release.pk)

    local_agent.answer("deploy", DeployResult(ok=True, endpoint="http://a:8000"))

    assert state(release) == "live"
    assert not local_agent.pending("undeploy")


# -- a re-verification answered after its copy stopped being live ---------------------


def go_live(release, actor):
    deployment = do_start_deployment(release, actor=actor)
    return do_complete_deployment(deployment, actor=actor, endpoint="http://a:8000")


@pytest.fixture
def two_live(make_release, owner, queued):
    """1.0.1 went live, then 1.0.2 (each with its own digest)."""
    releases = []
    for n in (1, 2):
        release = make_release(state="approved", manifest_digest=f"sha256:{n}" * 4)
        go_live(release, owner)
        releases.append(release)
    return releases


def fail_reverification(local_agent) -> None:
    local_agent.answer(
        "reverify",
        VerifyResult(ok=False, manifest_digest="", changed=["config.json"]),
        error="manifest mismatch; changed: config.json",
    )


def test_a_failed_reverification_of_a_copy_superseded_meanwhile_quarantines_it(
    two_live, make_release, owner, environment, local_agent
):
    _, second = two_live
    run_reverification(Deployment.objects.get(release=second, state="live").pk)
    third = make_release(state="approved", manifest_digest="sha256:" + "3" * 64)
    go_live(third, owner)  # second is now the rollback target
    assert previous_verified_deployment(environment).release == second

    fail_reverification(local_agent)

    assert state(second) == "quarantined"
    assert "changed: config.json" in Release.objects.get(pk=second.pk).failure_reason
    assert previous_verified_deployment(environment).release == two_live[0]
    assert state(third) == "live"  # the result was about second's copy only


def test_a_failed_reverification_of_a_copy_rolled_back_meanwhile_quarantines_it(
    two_live, environment, teammate, local_agent
):
    first, second = two_live
    run_reverification(Deployment.objects.get(release=second, state="live").pk)
    do_rollback_environment(environment, teammate)
    assert state(second) == "rolled_back"

    fail_reverification(local_agent)

    assert state(second) == "quarantined"
    assert state(first) == "deploying"  # the rollback goes on


def test_a_failed_reverification_of_a_copy_being_rolled_back_to_moves_on(
    two_live, make_release, owner, environment, teammate, local_agent
):
    first, second = two_live
    old_copy = Deployment.objects.get(release=second, state="live")
    run_reverification(old_copy.pk)
    go_live(make_release(state="approved", manifest_digest="sha256:" + "3" * 64), owner)
    do_rollback_environment(environment, teammate)  # back to second
    assert run_deployment(second.pk) == "deploying"

    fail_reverification(local_agent)

    assert state(second) == "quarantined"
    assert state(first) == "deploying"  # the rollback's next candidate
    refused = Deployment.objects.filter(release=second).exclude(pk=old_copy.pk).get()
    assert (refused.state, refused.ended is not None) == ("failed_verification", True)
    assert environment.live_deployment is None  # nothing refused counts as served
    # The refused deploy still answers: its server is stopped, never made live.
    local_agent.answer(
        "deploy", DeployResult(ok=True, endpoint="http://a:1", deployment_id="srv-2")
    )
    assert state(second) == "quarantined"
    (_, undeploy), *_ = local_agent.pending("undeploy")
    assert (undeploy.deployment_id, undeploy.serving_id) == (refused.pk, "srv-2")


def test_a_reverify_job_names_the_deployment_it_was_sent_for(two_live, local_agent):
    _, second = two_live
    deployment = Deployment.objects.get(release=second, state="live")

    run_reverification(deployment.pk)

    job = Job.objects.get(release=second, kind="reverify")
    assert job.deployment == deployment
    (_, request), *_ = local_agent.pending("reverify")
    assert request.deployment_id == deployment.pk


# -- a gate policy changed between the gate and the approval --------------------------


@pytest.fixture
def gated(make_release, environment, owner):
    """A release awaiting approval whose recorded evidence passed the gate
    (policy version 1)."""
    do_set_gate_policy(environment, {}, actor=owner)
    release = make_release(
        state="awaiting_approval", manifest_digest=DIGEST, signature="{}"
    )
    for kind in ("verify_source", "sign", "verify"):
        do_finish_job(do_dispatch_job(release, kind), result={})
    for kind, report in (("evaluate", quality_report()), ("load_test", load_report())):
        do_finish_job(do_dispatch_job(release, kind), result=report.model_dump())
    assert integrity_ok(release) is True
    decision = do_evaluate_release_gates(
        release, quality=quality_report(), load=load_report(), integrity_ok=True
    )
    assert decision.ok, decision
    return release


def test_gate_results_record_the_policy_version(gated):
    assert {r.policy_version for r in gated.gate_results.all()} == {1}


def test_every_policy_change_bumps_its_version(environment, owner):
    do_set_gate_policy(environment, {}, actor=owner)
    do_update_gate_policy(environment, {"quality": None}, actor=owner)

    assert EnvironmentGatePolicy.objects.get(environment=environment).version == 2


def test_an_approval_under_a_tightened_policy_is_refused_with_the_reason(
    gated, environment, owner, teammate, queued
):
    do_update_gate_policy(
        environment, {"load": {"thresholds": {"max_ttft_p99_ms": 1}}}, actor=owner
    )

    with pytest.raises(GatesNoLongerPass) as refused:
        do_approve_release(gated, teammate)

    assert "changed since the gate ran (version 1 -> 2)" in refused.value.message
    assert "load:chat (ttft_p99_ms)" in refused.value.message
    assert state(gated) == "awaiting_approval"
    assert not gated.approvals.exists()
    assert queued("run_deployment") == []
    event = AuditEvent.objects.get(verb="release.approval_refused")
    assert "load:chat (ttft_p99_ms)" in event.after["reason"]
    assert {r.policy_version for r in gated.gate_results.all()} == {2}
    with pytest.raises(GatesNoLongerPass):  # the new results fail too
        do_approve_release(gated, teammate)


def test_an_approval_under_a_changed_policy_that_still_passes_goes_through(
    gated, environment, owner, teammate
):
    do_update_gate_policy(
        environment, {"auto_rollback_on_failed_verification": True}, actor=owner
    )

    do_approve_release(gated, teammate)

    assert state(gated) == "approved"
    assert {r.policy_version for r in gated.gate_results.all()} == {2}
    evaluated = AuditEvent.objects.filter(verb="gate.evaluated").order_by("-id")[0]
    assert "version 1 -> 2" in evaluated.after["why"]


# -- a cost model changed between the gate and the approval ---------------------------

COST_POLICY = {
    "quality": None,
    "load": {"per_workload": {"chat": {"max_cost_per_1m_output_tokens": 1000}}},
}


@pytest.fixture
def cost_gated(make_release, environment, owner):
    """A release awaiting approval whose chat cost passed its limit (1000 per 1M
    output tokens) at 2 USD a device-hour."""
    do_set_cost_model(
        environment, {"currency": "USD", "device_hourly_price": "2"}, actor=owner
    )
    do_set_gate_policy(environment, COST_POLICY, actor=owner)
    release = make_release(
        state="awaiting_approval", manifest_digest=DIGEST, signature="{}"
    )
    for kind in ("verify_source", "sign", "verify"):
        do_finish_job(do_dispatch_job(release, kind), result={})
    do_finish_job(
        do_dispatch_job(release, "load_test"), result=load_report().model_dump()
    )
    decision = do_evaluate_release_gates(
        release, quality=None, load=load_report(), integrity_ok=True
    )
    assert decision.ok, decision
    assert chat_cost(release) < 1000
    return release


def chat_cost(release) -> float:
    """The chat cost per 1M output tokens its gate result observed (failing the
    gate above 1000)."""
    result = release.gate_results.get(
        gate="load:chat", metric="cost_per_1m_output_tokens"
    )
    assert result.outcome == ("pass" if result.observed <= 1000 else "fail")
    return result.observed


def test_an_approval_after_a_price_rise_fails_the_cost_gate_with_the_reason(
    cost_gated, environment, owner, teammate, queued
):
    # a device-hour so dear that chat now costs more than its limit
    price = f"{2 * 2000 / chat_cost(cost_gated):.2f}"
    do_update_cost_model(environment, {"device_hourly_price": price}, actor=owner)

    with pytest.raises(GatesNoLongerPass) as refused:
        do_approve_release(cost_gated, teammate)

    message = refused.value.message
    assert "(or the cost model its cost checks price with) changed" in message
    assert "since the gate ran (version 1 -> 2)" in message
    assert "load:chat (cost_per_1m_output_tokens)" in message
    assert state(cost_gated) == "awaiting_approval"
    assert queued("run_deployment") == []
    assert chat_cost(cost_gated) > 1000
    bumped = AuditEvent.objects.get(verb="environment.gate_policy_version_bumped")
    assert bumped.after == {
        "version": 2,
        "why": "the cost model its cost checks price with changed",
    }


@pytest.mark.parametrize(
    "change",
    [
        {"currency": "USD"},  # the same prices
        {"target_requests_per_s": {"chat": 5.0}, "note": "peak"},  # no price
    ],
)
def test_a_cost_model_change_that_prices_nothing_new_is_no_policy_change(
    cost_gated, environment, owner, teammate, change
):
    do_update_cost_model(environment, change, actor=owner)

    do_approve_release(cost_gated, teammate)

    assert state(cost_gated) == "approved"
    assert EnvironmentGatePolicy.objects.get(environment=environment).version == 1


def test_a_price_change_under_a_policy_without_cost_checks_is_no_policy_change(
    gated, environment, owner
):
    do_set_cost_model(
        environment, {"currency": "USD", "device_hourly_price": "9"}, actor=owner
    )

    assert EnvironmentGatePolicy.objects.get(environment=environment).version == 1
