import time

import pytest

from controlplane.dispatch.models import OutboxMessage
from controlplane.releases.actions.gate_policies import (
    do_set_gate_policy,
    do_update_gate_policy,
)
from controlplane.releases.actions.gate_results import do_evaluate_release_gates
from controlplane.releases.models import Approval, Release
from tests.controlplane.api.helpers import DIGEST, STALE_DIGEST, error_of, field_names
from tests.controlplane.api.test_reject_release import signed_again_once_read


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}/approve"


@pytest.fixture
def waiting(make_release):
    return make_release("2.0.0", state="awaiting_approval", manifest_digest=DIGEST)


def approve(api, release, token, digest=DIGEST):
    return api.post(
        url(release.pk),
        {"manifest_digest": digest, "comment": "kld ok"},
        token=token,
    )


def test_it_lets_a_teammate_approver_approve(
    api, approver_token, teammate, waiting, queued
):
    response = approve(api, waiting, approver_token)

    assert response.status_code == 200, response.content
    waiting.refresh_from_db()
    assert waiting.state == "approved"
    approval = Approval.objects.get(release=waiting)
    assert (approval.user, approval.decision) == (teammate, "approve")
    assert approval.manifest_digest == DIGEST
    assert approval.token.prefix == approver_token[:8]
    assert response.json()["approval"]["comment"] == "kld ok"
    assert queued("run_deployment") == [(waiting.pk,)]


def test_it_refuses_the_token_that_registered_the_release(
    api, make_token, teammate, model_family, environment, make_source
):
    # The teammate registers through a token that can also approve: that token (and
    # its user) may not approve what it registered.
    token = make_token(teammate, "read", "register", "approve")
    registered = api.post(
        "/api/v1/releases",
        {
            "model": model_family.name,
            "version": "9.0.0",
            "source_uri": make_source("x").as_uri(),
            "recipe": {"weights": "int8", "kv_cache_dtype": "int8"},
            "target_environment": environment.name,
        },
        token=token,
    )
    release_id = registered.json()["id"]
    from controlplane.releases.models import Release

    Release.objects.filter(pk=release_id).update(
        state="awaiting_approval", manifest_digest=DIGEST
    )

    response = api.post(url(release_id), {"manifest_digest": DIGEST}, token=token)

    error = error_of(response, 403, "separation_of_duties")
    assert "registered" in error["message"]
    assert not Approval.objects.exists()


def test_it_refuses_the_user_that_registered_the_release_with_another_token(
    api, make_token, owner, waiting
):
    # `waiting` was registered by owner (an admin, so the role would allow it).
    token = make_token(owner, "approve")

    error = error_of(approve(api, waiting, token), 403, "separation_of_duties")

    assert "alice" in error["message"]
    waiting.refresh_from_db()
    assert waiting.state == "awaiting_approval"


def test_it_refuses_a_stale_manifest_digest(api, approver_token, waiting):
    response = approve(api, waiting, approver_token, digest=STALE_DIGEST)

    error = error_of(response, 409, "manifest_digest_mismatch")
    assert field_names(error) == {"manifest_digest"}
    waiting.refresh_from_db()
    assert waiting.state == "awaiting_approval"
    assert not Approval.objects.exists()


def test_it_refuses_a_member_without_the_approver_role(
    api, make_token, member, waiting
):
    token = make_token(member, "approve")

    error = error_of(approve(api, waiting, token), 403, "forbidden")

    assert "approver" in error["message"]


def test_it_refuses_a_release_not_awaiting_approval(api, approver_token, make_release):
    release = make_release("3.0.0", manifest_digest=DIGEST)

    error_of(approve(api, release, approver_token), 409, "illegal_transition")


def test_it_needs_the_manifest_digest(api, approver_token, waiting):
    response = api.post(url(waiting.pk), {"comment": "lgtm"}, token=approver_token)

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"manifest_digest"}


def test_it_needs_a_token(api, waiting):
    error_of(approve(api, waiting, None), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, waiting):
    error_of(approve(api, waiting, "rg_bogus"), 401, "not_authenticated")


def test_it_needs_the_approve_scope(api, make_token, teammate, waiting):
    token = make_token(teammate, "read", "promote")

    assert error_of(approve(api, waiting, token), 403, "missing_scope")["scope"] == (
        "approve"
    )


def test_it_does_not_accept_a_dashboard_session(client, teammate, waiting):
    # The API takes decisions from tokens only; the dashboard has its own form.
    client.force_login(teammate)

    response = client.post(
        url(waiting.pk), {"manifest_digest": DIGEST}, content_type="application/json"
    )

    error_of(response, 401, "not_authenticated")


def test_it_hides_the_release_from_an_outsider(api, outsider_token, waiting):
    error_of(approve(api, waiting, outsider_token), 404, "not_found")


def test_it_approves_fast_with_the_broker_down_and_keeps_the_deployment_task(
    api,
    approver_token,
    waiting,
    broker_at,
    unreachable_broker_url,
    django_capture_on_commit_callbacks,
):
    broker_at(unreachable_broker_url)
    started = time.monotonic()

    with django_capture_on_commit_callbacks(execute=True):
        response = approve(api, waiting, approver_token)

    assert time.monotonic() - started < 5  # was a 500 after ~19 s
    assert response.status_code == 200, response.content
    assert Release.objects.get(pk=waiting.pk).state == "approved"
    message = OutboxMessage.objects.get(task="controlplane.releases.run_deployment")
    assert (message.args, message.sent) == ([waiting.pk], None)


def test_it_refuses_a_digest_that_changes_before_the_approval_commits(
    api, approver_token, waiting, monkeypatch, queued
):
    signed_again_once_read(monkeypatch, STALE_DIGEST)

    response = approve(api, waiting, approver_token)

    error_of(response, 409, "manifest_digest_mismatch")
    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"
    assert queued("run_deployment") == []


def test_it_refuses_when_the_gate_policy_changed_and_the_evidence_no_longer_passes(
    api, approver_token, waiting, environment, owner, queued
):
    do_set_gate_policy(environment, {"quality": None, "load": None}, actor=owner)
    assert do_evaluate_release_gates(
        waiting, quality=None, load=None, integrity_ok=True
    ).ok
    do_update_gate_policy(environment, {"quality": {}}, actor=owner)  # on again

    response = approve(api, waiting, approver_token)

    error = error_of(response, 409, "gates_no_longer_pass")
    assert "changed since the gate ran (version 1 -> 2)" in error["message"]
    assert "quality" in error["message"]
    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"
    assert not Approval.objects.exists()
    assert queued("run_deployment") == []
