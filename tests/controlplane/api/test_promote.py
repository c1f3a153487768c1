import time
import uuid

import pytest
from django.utils import timezone

from controlplane import celery_app
from controlplane.audit.models import AuditEvent
from controlplane.dispatch.models import OutboxMessage
from controlplane.dispatch.tasks import relay_outbox
from controlplane.releases import tasks
from tests.controlplane.api.helpers import error_of
from tests.controlplane.test_worker_integration import celery_worker


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


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_it_answers_202_fast_with_redis_down_and_the_work_runs_once_it_is_back(
    api,
    owner_token,
    release,
    redis_server,
    broker_at,
    result_store_at,
    monkeypatch,
    tmp_path,
):
    # PostgreSQL + Redis mode: one Redis is the broker and the result store.
    broker, results = redis_server.url(3), redis_server.url(4)
    broker_at(broker)
    result_store_at(results)
    queue = f"promote-{uuid.uuid4().hex[:8]}"
    monkeypatch.setitem(celery_app.conf, "task_default_queue", queue)
    redis_server.stop()
    started = time.monotonic()

    response = api.post(url(release.pk), token=owner_token)

    answered_s = time.monotonic() - started
    assert response.status_code == 202, response.content
    assert answered_s < 2  # was ~19 s: the result store's 20 retries 1 s apart
    message = OutboxMessage.objects.get(task="controlplane.releases.run_promotion")
    assert (message.sent, message.attempts) == (None, 1)
    assert "refused" in message.last_error.lower()

    redis_server.start()  # empty: what the broker held is gone, the outbox is not
    worker_log = tmp_path / "worker.log"
    with celery_worker(
        worker_log, queue, CELERY_BROKER_URL=broker, CELERY_RESULT_BACKEND=results
    ) as (process, _):
        OutboxMessage.objects.filter(pk=message.pk).update(next_attempt=timezone.now())
        assert relay_outbox() == 1
        deadline = time.monotonic() + 60
        while not release.jobs.filter(kind="verify_source").exists():
            assert process.poll() is None, worker_log.read_text()
            assert time.monotonic() < deadline, worker_log.read_text()
            time.sleep(0.2)
    release.refresh_from_db()
    assert release.state == "verifying"
    print(f"promote with Redis down answered {answered_s:.2f} s")
