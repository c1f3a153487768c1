import pytest

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict, Forbidden
from controlplane.releases.actions.promotion import do_request_promotion
from controlplane.releases.models import Release


def test_it_queues_the_pipeline_with_the_write(release, member, queued):
    do_request_promotion(release, member)

    assert queued("run_promotion") == [(release.pk,)]
    assert AuditEvent.objects.filter(verb="release.promotion_requested").count() == 1


def test_it_retries_a_failed_release(make_release, owner, queued):
    release = make_release(state="failed", failure_reason="oom")

    do_request_promotion(release, owner)

    stored = Release.objects.get(pk=release.pk)
    assert stored.state == "registered"
    assert stored.failure_reason == ""
    assert queued("run_promotion") == [(release.pk,)]


@pytest.mark.parametrize("state", ["awaiting_approval", "live", "quarantined"])
def test_it_refuses_releases_outside_the_pipeline(make_release, owner, queued, state):
    release = make_release(state=state)

    with pytest.raises(Conflict):
        do_request_promotion(release, owner)

    assert queued("run_promotion") == queued("run_deployment") == []


def test_it_refuses_outsiders(release, outsider, queued):
    with pytest.raises(Forbidden):
        do_request_promotion(release, outsider)

    assert queued("run_promotion") == []


def test_it_requires_the_promote_scope(release, owner, team, queued):
    token, _ = ApiToken.create(owner, team, "ci", ["register", "read"])

    with pytest.raises(Forbidden):
        do_request_promotion(release, token)


@pytest.mark.parametrize("state", ["approved", "deploying"])
def test_it_resumes_the_deployment_of_an_approved_release(
    make_release, owner, queued, state
):
    # The approval's deployment task died: without this the release could never
    # leave approved/deploying.
    release = make_release(state=state)

    do_request_promotion(release, owner)

    assert Release.objects.get(pk=release.pk).state == state
    assert queued("run_deployment") == [(release.pk,)]
    assert queued("run_promotion") == []
    event = AuditEvent.objects.get(verb="release.promotion_requested")
    assert event.after == {"state": state}
