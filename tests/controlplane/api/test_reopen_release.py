import pytest

from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict
from controlplane.releases.actions.approvals import (
    do_approve_release,
    do_reject_release,
)
from controlplane.releases.actions.manifests import do_record_manifest
from controlplane.releases.actions.promotion import do_reopen_release
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Release
from gpuagent.protocol import FileDigest
from tests.controlplane.api.helpers import DIGEST, STALE_DIGEST, error_of


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}/reopen"


def test_it_reopens_a_rejected_release_and_it_can_be_promoted_again(
    api, owner_token, make_release, teammate, queued
):
    release = make_release(state="awaiting_approval", manifest_digest=DIGEST)
    do_reject_release(release, teammate, comment="top-1 too low on korean")
    refused = api.post(f"/api/v1/releases/{release.pk}/promote", token=owner_token)
    assert "reopen it" in error_of(refused, 409, "conflict")["message"]

    response = api.post(url(release.pk), {"reason": "recalibrated"}, token=owner_token)

    assert response.status_code == 200, response.content
    assert response.json()["release"]["state"] == "registered"
    stored = Release.objects.get(pk=release.pk)
    assert (stored.state, stored.failure_reason) == ("registered", "")
    event = AuditEvent.objects.get(verb="release.reopened")
    assert event.before["failure_reason"] == "top-1 too low on korean"
    assert event.after["reason"] == "recalibrated"
    promoted = api.post(f"/api/v1/releases/{release.pk}/promote", token=owner_token)
    assert promoted.status_code == 202, promoted.content
    assert queued("run_promotion") == [(release.pk,)]


def test_an_earlier_approval_no_longer_binds_the_manifest(
    make_release, owner, teammate
):
    release = make_release(state="awaiting_approval", manifest_digest=DIGEST)
    do_approve_release(release, teammate, manifest_digest=DIGEST)
    do_transition_release(release, "deploying", actor="system:worker")
    do_transition_release(release, "failed", actor="system:worker", reason="oom")
    files = [FileDigest(path="model.safetensors", size_bytes=1, digest=STALE_DIGEST)]
    with pytest.raises(Conflict, match="approved for"):
        do_record_manifest(release, manifest_digest=STALE_DIGEST, files=files)

    do_reopen_release(release, owner, reason="rebuilt from a fixed source")
    do_record_manifest(release, manifest_digest=STALE_DIGEST, files=files)

    assert Release.objects.get(pk=release.pk).manifest_digest == STALE_DIGEST


@pytest.mark.parametrize("state", ["live", "quarantined", "registered"])
def test_it_refuses_other_states_and_says_what_to_do(
    api, owner_token, make_release, state
):
    release = make_release(state=state)

    response = api.post(url(release.pk), {"reason": "again"}, token=owner_token)

    error = error_of(response, 409, "conflict")
    if state == "quarantined":
        assert "register a new version" in error["message"]
    assert Release.objects.get(pk=release.pk).state == state


def test_it_needs_a_reason_and_the_promote_scope(
    api, make_token, owner, owner_token, make_release, outsider_token
):
    release = make_release(state="failed", failure_reason="oom")

    error_of(
        api.post(url(release.pk), {"reason": ""}, token=owner_token),
        422,
        "validation_error",
    )
    read_only = make_token(owner, "read")
    error = error_of(
        api.post(url(release.pk), {"reason": "x"}, token=read_only),
        403,
        "missing_scope",
    )
    assert error["scope"] == "promote"
    error_of(
        api.post(url(release.pk), {"reason": "x"}, token=outsider_token),
        404,
        "not_found",
    )
    assert Release.objects.get(pk=release.pk).state == "failed"
