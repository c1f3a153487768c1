import pytest

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict, Forbidden
from controlplane.releases import tasks
from controlplane.releases.actions import do_request_promotion
from controlplane.releases.models import Release


@pytest.fixture
def queued(monkeypatch):
    calls = []
    monkeypatch.setattr(tasks.run_promotion, "delay", lambda *a: calls.append(a))
    return calls


def test_it_queues_the_pipeline_on_commit(
    release, member, queued, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        do_request_promotion(release, member)
        assert queued == []  # nothing leaves before the transaction commits

    assert len(callbacks) == 1
    assert queued == [(release.pk,)]
    assert AuditEvent.objects.filter(verb="release.promotion_requested").count() == 1


def test_it_retries_a_failed_release(
    make_release, owner, queued, django_capture_on_commit_callbacks
):
    release = make_release(state="failed", failure_reason="oom")

    with django_capture_on_commit_callbacks(execute=True):
        do_request_promotion(release, owner)

    stored = Release.objects.get(pk=release.pk)
    assert stored.state == "registered"
    assert stored.failure_reason == ""
    assert queued == [(release.pk,)]


@pytest.mark.parametrize("state", ["awaiting_approval", "live", "quarantined"])
def test_it_refuses_releases_outside_the_pipeline(
    make_release, owner, queued, state, django_capture_on_commit_callbacks
):
    release = make_release(state=state)

    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(Conflict):
            do_request_promotion(release, owner)

    assert queued == []


def test_it_refuses_outsiders(release, outsider, queued):
    with pytest.raises(Forbidden):
        do_request_promotion(release, outsider)


def test_it_requires_the_promote_scope(release, owner, team, queued):
    token, _ = ApiToken.create(owner, team, "ci", ["register", "read"])

    with pytest.raises(Forbidden):
        do_request_promotion(release, token)


@pytest.mark.parametrize("state", ["approved", "deploying"])
def test_it_resumes_the_deployment_of_an_approved_release(
    make_release,
    owner,
    queued,
    state,
    monkeypatch,
    django_capture_on_commit_callbacks,
):
    # The approval's own queueing was lost (broker down at commit, or the task died):
    # without this the release could never leave approved/deploying.
    deploys = []
    monkeypatch.setattr(tasks.run_deployment, "delay", lambda *a: deploys.append(a))
    release = make_release(state=state)

    with django_capture_on_commit_callbacks(execute=True):
        do_request_promotion(release, owner)

    assert Release.objects.get(pk=release.pk).state == state
    assert deploys == [(release.pk,)]
    assert queued == []
    event = AuditEvent.objects.get(verb="release.promotion_requested")
    assert event.after == {"state": state}
