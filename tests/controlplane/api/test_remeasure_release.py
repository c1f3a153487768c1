"""POST /api/v1/releases/{id}/remeasure: a judged, unapproved release runs the
stages named again (the load test under its environment's plan), then its gate;
409 in any other state or while one runs; audited."""

import shutil

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.loadplans.actions import do_set_load_plan
from controlplane.releases.models import Job, Release
from gpuagent.protocol import LOAD_PROFILES, default_load_plan
from tests.controlplane.api.helpers import error_of
from tests.controlplane.releases.test_evaluate_policy import (
    load_report,
    quality_report,
    workload,
)
from tests.controlplane.releases.test_pipeline import (
    BF16,
    DEMO_MODEL,
    promote_to_tests,
)


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}/remeasure"


@pytest.fixture
def bf16_release(make_release, make_source):
    """A release of a copy of the demo model (the compress job loads it)."""
    folder = make_source("model")
    for path in DEMO_MODEL.iterdir():
        if path.is_file():
            shutil.copyfile(path, folder / path.name)
    return make_release(source_uri=folder.as_uri(), recipe=BF16)


@pytest.fixture
def inconclusive(bf16_release, local_agent):
    """A release whose load test reported one workload of the six its gate
    requires: inconclusive, paused in gated."""
    promote_to_tests(bf16_release, local_agent)
    local_agent.answer("evaluate", quality_report())
    local_agent.answer("load_test", load_report(workload("chat")))
    bf16_release.refresh_from_db()
    assert bf16_release.state == "gated"
    gate = Job.objects.filter(release=bf16_release, kind="gate").latest("id")
    assert gate.result["outcome"] == "inconclusive"
    return bf16_release


def test_it_takes_a_gated_release_to_a_new_gate_result(
    api, owner_token, owner, inconclusive, local_agent
):
    release = inconclusive
    plan = default_load_plan().model_copy(update={"budget_s": 30.0})
    do_set_load_plan(release.target_environment, plan.model_dump(), actor=owner)

    response = api.post(url(release.pk), {"stages": ["load_test"]}, token=owner_token)

    assert response.status_code == 202, response.content
    assert response["Location"].endswith(f"/releases/{release.pk}")
    (_, request), *more = local_agent.pending()
    assert not more and request.kind == "load_test"  # evaluate is not run again
    assert request.load_plan == plan  # the plan in force travels with the job
    assert Release.objects.get(pk=release.pk).state == "gated"  # waits for it
    assert Job.objects.filter(release=release, kind="gate").count() == 1

    local_agent.answer("load_test", load_report())

    release.refresh_from_db()
    assert release.state == "awaiting_approval", release.failure_reason
    gates = Job.objects.filter(release=release, kind="gate").order_by("id")
    assert [g.result["outcome"] for g in gates] == ["inconclusive", "pass"]
    event = AuditEvent.objects.get(verb="release.remeasure_requested")
    assert event.before["state"] == "gated"
    assert event.after["stages"] == ["load_test"]


def test_a_release_awaiting_approval_goes_back_to_gated_until_its_new_gate(
    api, owner_token, inconclusive, local_agent
):
    release = inconclusive
    api.post(url(release.pk), {"stages": ["load_test"]}, token=owner_token)
    local_agent.answer("load_test", load_report())
    release.refresh_from_db()
    assert release.state == "awaiting_approval"

    response = api.post(
        url(release.pk), {"stages": ["load_test", "evaluate"]}, token=owner_token
    )

    assert response.status_code == 202, response.content
    assert Release.objects.get(pk=release.pk).state == "gated"
    busy = api.post(url(release.pk), {"stages": ["evaluate"]}, token=owner_token)
    assert "being measured already" in error_of(busy, 409, "conflict")["message"]
    local_agent.answer("load_test", load_report())
    assert Release.objects.get(pk=release.pk).state == "gated"  # evaluate runs
    local_agent.answer("evaluate", error="the agent ran out of memory")
    release.refresh_from_db()
    assert release.state == "failed"
    assert "evaluate: the agent ran out of memory" in release.failure_reason
    # a failed job is no gate's fail: reopen it, re-measuring is refused
    again = api.post(url(release.pk), {"stages": ["evaluate"]}, token=owner_token)
    assert "not by its gate" in error_of(again, 409, "conflict")["message"]


def test_a_release_its_gate_failed_is_measured_and_gated_again(
    api, owner_token, bf16_release, local_agent
):
    promote_to_tests(bf16_release, local_agent)
    local_agent.answer("evaluate", quality_report())
    slow = [workload(p, ttft_p99_ms=90000.0) for p in LOAD_PROFILES]
    local_agent.answer("load_test", load_report(*slow))
    bf16_release.refresh_from_db()
    assert bf16_release.state == "failed"
    assert "ttft_p99_ms" in bf16_release.failure_reason

    response = api.post(
        url(bf16_release.pk), {"stages": ["load_test"]}, token=owner_token
    )

    assert response.status_code == 202, response.content
    assert response.json()["release"]["state"] == "gated"
    local_agent.answer("load_test", load_report())
    assert Release.objects.get(pk=bf16_release.pk).state == "awaiting_approval"


@pytest.mark.parametrize("state", ["registered", "evaluating", "approved", "live"])
def test_it_refuses_a_release_no_gate_has_judged_or_one_approved(
    api, owner_token, make_release, state
):
    release = make_release(state=state)

    response = api.post(url(release.pk), {"stages": ["evaluate"]}, token=owner_token)

    message = error_of(response, 409, "conflict")["message"]
    assert f"is {state}" in message and "can be re-measured" in message
    assert not Job.objects.filter(release=release).exists()


@pytest.mark.parametrize(
    "body", [{}, {"stages": []}, {"stages": ["deploy"]}, {"stages": ["evaluate"] * 2}]
)
def test_it_names_the_stages_it_refuses(api, owner_token, make_release, body):
    release = make_release(state="gated")

    response = api.post(url(release.pk), body, token=owner_token)

    assert response.status_code == 422, response.content
    assert not Job.objects.filter(release=release).exists()


def test_it_needs_the_promote_scope(api, make_token, owner, make_release):
    release = make_release(state="gated")

    response = api.post(
        url(release.pk), {"stages": ["evaluate"]}, token=make_token(owner, "read")
    )

    assert error_of(response, 403, "missing_scope")["scope"] == "promote"
