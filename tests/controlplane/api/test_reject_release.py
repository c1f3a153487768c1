import pytest

from controlplane.releases.models import Approval
from tests.controlplane.api.helpers import DIGEST, STALE_DIGEST, error_of, field_names


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}/reject"


@pytest.fixture
def waiting(make_release):
    return make_release("2.0.0", state="awaiting_approval", manifest_digest=DIGEST)


def reject(api, release, token, **body):
    return api.post(
        url(release.pk), {"comment": "p99 KLD too high", **body}, token=token
    )


def test_it_lets_an_approver_reject(api, approver_token, teammate, waiting):
    response = reject(api, waiting, approver_token, manifest_digest=DIGEST)

    assert response.status_code == 200, response.content
    waiting.refresh_from_db()
    assert waiting.state == "rejected"
    assert waiting.failure_reason == "p99 KLD too high"
    approval = Approval.objects.get(release=waiting)
    assert (approval.user, approval.decision) == (teammate, "reject")


def test_it_refuses_a_stale_manifest_digest(api, approver_token, waiting):
    response = reject(api, waiting, approver_token, manifest_digest=STALE_DIGEST)

    assert field_names(error_of(response, 409, "manifest_digest_mismatch")) == {
        "manifest_digest"
    }
    waiting.refresh_from_db()
    assert waiting.state == "awaiting_approval"


def test_it_needs_a_comment(api, approver_token, waiting):
    response = api.post(url(waiting.pk), {}, token=approver_token)

    assert field_names(error_of(response, 422, "validation_error")) == {"comment"}


def test_it_refuses_a_member_without_the_approver_role(
    api, make_token, member, waiting
):
    error_of(reject(api, waiting, make_token(member, "approve")), 403, "forbidden")
    waiting.refresh_from_db()
    assert waiting.state == "awaiting_approval"


def test_it_needs_a_token(api, waiting):
    error_of(reject(api, waiting, None), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, waiting):
    error_of(reject(api, waiting, "rg_bogus"), 401, "not_authenticated")


def test_it_needs_the_approve_scope(api, owner_token, waiting):
    assert (
        error_of(reject(api, waiting, owner_token), 403, "missing_scope")["scope"]
        == "approve"
    )


def test_it_hides_the_release_from_an_outsider(api, outsider_token, waiting):
    error_of(reject(api, waiting, outsider_token), 404, "not_found")
    waiting.refresh_from_db()
    assert waiting.state == "awaiting_approval"
