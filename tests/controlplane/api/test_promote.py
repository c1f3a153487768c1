import pytest

from controlplane.audit.models import AuditEvent
from controlplane.releases import tasks
from tests.controlplane.api.helpers import error_of


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}/promote"


@pytest.fixture
def sent_promotions(monkeypatch) -> list[tuple]:
    """What was handed to Celery for run_promotion. The real worker is the
    integration test's business; here the test runs the task in-process."""
    sent: list[tuple] = []
    monkeypatch.setattr(tasks.run_promotion, "delay", lambda *args: sent.append(args))
    return sent


def test_it_queues_the_pipeline_on_commit_and_answers_202(
    api, owner_token, release, sent_promotions, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = api.post(url(release.pk), token=owner_token)

    assert response.status_code == 202, response.content
    status_url = response.json()["status_url"]
    assert status_url.endswith(f"/api/v1/releases/{release.pk}")
    assert response["Location"] == status_url
    # Nothing ran before the commit; exactly one task was queued for it.
    release.refresh_from_db()
    assert release.state == "registered"
    assert len(callbacks) == 1
    assert AuditEvent.objects.filter(verb="release.promotion_requested").exists()

    assert sent_promotions == []

    callbacks[0]()
    assert sent_promotions == [(release.pk,)]
    assert tasks.run_promotion(release.pk) == "awaiting_approval"

    release.refresh_from_db()
    assert release.state == "awaiting_approval"
    status = api.get(status_url, token=owner_token).json()
    assert status["state"] == "awaiting_approval"
    # The status URL shows the pipeline's jobs as they are in the database (which
    # stages exist is the pipeline's business, not the API's).
    assert [j["kind"] for j in status["jobs"]] == list(
        release.jobs.order_by("created", "id").values_list("kind", flat=True)
    )
    assert status["jobs"] and all(j["state"] == "succeeded" for j in status["jobs"])


def test_it_refuses_a_release_past_the_pipeline(
    api, owner_token, make_release, django_capture_on_commit_callbacks
):
    release = make_release("2.0.0", state="live")

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = api.post(url(release.pk), token=owner_token)

    error_of(response, 409, "conflict")
    assert callbacks == []


def test_it_needs_a_token(api, release):
    error_of(api.post(url(release.pk)), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, release):
    error_of(api.post(url(release.pk), token="garbage"), 401, "not_authenticated")


def test_it_rejects_a_revoked_token(api, owner_token, release):
    from controlplane.accounts.actions import do_revoke_api_token
    from controlplane.accounts.models import ApiToken

    do_revoke_api_token(ApiToken.objects.get(prefix=owner_token[:8]))

    error_of(api.post(url(release.pk), token=owner_token), 401, "not_authenticated")


def test_it_needs_the_promote_scope(
    api, make_token, owner, release, django_capture_on_commit_callbacks
):
    token = make_token(owner, "read", "register")

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        error = error_of(api.post(url(release.pk), token=token), 403, "missing_scope")

    assert error["scope"] == "promote"
    assert callbacks == []


def test_it_hides_the_release_from_an_outsider(
    api, outsider_token, release, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = api.post(url(release.pk), token=outsider_token)

    error_of(response, 404, "not_found")
    assert callbacks == []


def test_it_names_a_bad_id(api, owner_token):
    error_of(api.post(url("x"), token=owner_token), 422, "validation_error")
