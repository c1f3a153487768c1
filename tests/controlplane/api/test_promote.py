import time

from controlplane.audit.models import AuditEvent
from controlplane.dispatch.models import OutboxMessage
from controlplane.releases import tasks
from tests.controlplane.api.helpers import error_of


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}/promote"


def test_it_queues_the_pipeline_and_answers_202(api, owner_token, release, queued):
    response = api.post(url(release.pk), token=owner_token)

    assert response.status_code == 202, response.content
    status_url = response.json()["status_url"]
    assert status_url.endswith(f"/api/v1/releases/{release.pk}")
    assert response["Location"] == status_url
    # Queued with the write; the worker moves the release, not the request.
    release.refresh_from_db()
    assert release.state == "registered"
    assert queued("run_promotion") == [(release.pk,)]
    assert AuditEvent.objects.filter(verb="release.promotion_requested").exists()

    # The worker sends the first job to an agent; the release waits for it.
    assert tasks.run_promotion(release.pk) == "verifying"

    status = api.get(status_url, token=owner_token).json()
    assert status["state"] == "verifying"
    # The status URL shows the pipeline's jobs as they are in the database (which
    # stages exist is the pipeline's business, not the API's).
    assert [j["kind"] for j in status["jobs"]] == list(
        release.jobs.order_by("created", "id").values_list("kind", flat=True)
    )
    assert [j["state"] for j in status["jobs"]] == ["queued"]
    assert status["timings"]["stages"][0]["kind"] == status["jobs"][0]["kind"]


def test_it_refuses_a_release_past_the_pipeline(api, owner_token, make_release, queued):
    release = make_release("2.0.0", state="live")

    response = api.post(url(release.pk), token=owner_token)

    error_of(response, 409, "conflict")
    assert queued("run_promotion") == queued("run_deployment") == []


def test_it_needs_a_token(api, release):
    error_of(api.post(url(release.pk)), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, release):
    error_of(api.post(url(release.pk), token="garbage"), 401, "not_authenticated")


def test_it_rejects_a_revoked_token(api, owner_token, release):
    from controlplane.accounts.actions import do_revoke_api_token
    from controlplane.accounts.models import ApiToken

    do_revoke_api_token(ApiToken.objects.get(prefix=owner_token[:8]))

    error_of(api.post(url(release.pk), token=owner_token), 401, "not_authenticated")


def test_it_needs_the_promote_scope(api, make_token, owner, release, queued):
    token = make_token(owner, "read", "register")

    error = error_of(api.post(url(release.pk), token=token), 403, "missing_scope")

    assert error["scope"] == "promote"
    assert queued("run_promotion") == []


def test_it_hides_the_release_from_an_outsider(api, outsider_token, release, queued):
    response = api.post(url(release.pk), token=outsider_token)

    error_of(response, 404, "not_found")
    assert queued("run_promotion") == []


def test_it_names_a_bad_id(api, owner_token):
    error_of(api.post(url("x"), token=owner_token), 422, "validation_error")


def test_it_answers_202_fast_with_the_broker_down_and_keeps_the_task(
    api,
    owner_token,
    release,
    broker_at,
    unreachable_broker_url,
    django_capture_on_commit_callbacks,
):
    broker_at(unreachable_broker_url)
    started = time.monotonic()

    with django_capture_on_commit_callbacks(execute=True):
        response = api.post(url(release.pk), token=owner_token)

    assert time.monotonic() - started < 5  # was a 500 after ~19 s
    assert response.status_code == 202, response.content
    message = OutboxMessage.objects.get(task="controlplane.releases.run_promotion")
    assert (message.args, message.sent, message.attempts) == ([release.pk], None, 1)
    assert "refused" in message.last_error.lower()
    assert AuditEvent.objects.filter(verb="release.promotion_requested").exists()
