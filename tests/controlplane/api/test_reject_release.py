import pytest

from controlplane.api import releases as release_views
from controlplane.releases.models import Approval, Release
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


def signed_again_once_read(monkeypatch, digest: str) -> None:
    """The release's manifest is recorded anew (a late sign job) right after the
    view has read the release, before the rejection commits."""
    read = release_views.get_release

    def read_then_resign(*args, **kwargs):
        release = read(*args, **kwargs)
        Release.objects.filter(pk=release.pk).update(manifest_digest=digest)
        return release

    monkeypatch.setattr(release_views, "get_release", read_then_resign)


def test_it_refuses_a_digest_that_changes_before_the_rejection_commits(
    api, approver_token, waiting, monkeypatch
):
    signed_again_once_read(monkeypatch, STALE_DIGEST)

    response = reject(api, waiting, approver_token, manifest_digest=DIGEST)

    error_of(response, 409, "manifest_digest_mismatch")
    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"
    assert not Approval.objects.filter(release=waiting).exists()


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
