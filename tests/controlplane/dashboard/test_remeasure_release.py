"""The release page's Re-measure form: offered where POST .../remeasure would be
(gated, awaiting approval, failed by its gate) to whoever may promote in the team,
confirmed in a second step, then the same pipeline.remeasure: the release gated,
the ticked stages' jobs queued for the agent, one audited event."""

import pytest
from django.test import Client

from controlplane.audit.models import AuditEvent
from controlplane.releases.models import Job, Release
from tests.controlplane.dashboard.builders import record_job


def _stored(release) -> Release:
    return Release.objects.get(pk=release.pk)


def _page(client, release) -> str:
    return client.get(f"/releases/{release.pk}/").content.decode()


def _jobs(release, kind: str) -> int:
    return Job.objects.filter(release=release, kind=kind).count()


@pytest.fixture
def failed_by_gate(make_release):
    release = make_release("1.0.0", state="failed", failure_reason="gate: ttft p99")
    record_job(release, "gate", {"outcome": "fail", "reason": "ttft p99"})
    return release


def test_it_offers_remeasure_on_a_release_awaiting_approval(client, member, awaiting):
    release = awaiting("1.0.0")
    client.force_login(member)

    body = _page(client, release)

    assert f'action="/releases/{release.pk}/remeasure/"' in body
    assert 'name="stages" value="evaluate"' in body
    assert 'name="stages" value="load_test"' in body


def test_it_offers_remeasure_on_a_gated_release(client, owner, make_release):
    release = make_release("1.0.0", state="gated")
    client.force_login(owner)

    assert f'action="/releases/{release.pk}/remeasure/"' in _page(client, release)


def test_it_offers_remeasure_on_a_release_its_gate_failed(
    client, member, failed_by_gate
):
    client.force_login(member)

    assert "/remeasure/" in _page(client, failed_by_gate)


@pytest.mark.parametrize("state", ["registered", "evaluating", "rejected"])
def test_it_offers_no_remeasure_in_other_states(client, owner, make_release, state):
    release = make_release("1.0.0", state=state)
    client.force_login(owner)

    body = _page(client, release)

    assert "/remeasure/" not in body
    assert 'id="remeasure-refusal"' not in body


def test_it_offers_no_remeasure_on_a_release_failed_by_a_job(
    client, owner, make_release
):
    release = make_release("1.0.0", state="failed", failure_reason="compress: OOM")
    client.force_login(owner)

    assert "/remeasure/" not in _page(client, release)


def test_it_asks_to_confirm_first(client, member, awaiting):
    release = awaiting("1.0.0")
    client.force_login(member)

    response = client.post(
        f"/releases/{release.pk}/remeasure/", {"stages": ["load_test"]}
    )

    assert response.status_code == 200
    body = response.content.decode()
    assert "Confirm re-measure" in body
    assert 'name="stages" value="load_test"' in body
    assert 'name="stages" value="evaluate"' not in body
    assert _stored(release).state == "awaiting_approval"
    assert _jobs(release, "load_test") == 1  # the first measurement's only


def test_it_remeasures_once_confirmed(client, member, awaiting, queued):
    release = awaiting("1.0.0")
    client.force_login(member)

    response = client.post(
        f"/releases/{release.pk}/remeasure/",
        {"stages": ["load_test"], "confirmed": "yes"},
        follow=True,
    )

    assert response.status_code == 200
    assert b"Re-measuring" in response.content
    assert _stored(release).state == "gated"
    assert (_jobs(release, "load_test"), _jobs(release, "evaluate")) == (2, 1)
    new = Job.objects.filter(release=release, kind="load_test").latest("id")
    assert new.state == "queued"
    assert [args[0]["job_id"] for args in queued("run_job")] == [new.pk]
    event = AuditEvent.objects.get(verb="release.remeasure_requested")
    assert event.actor_user == member
    assert (event.before["state"], event.after["stages"]) == (
        "awaiting_approval",
        ["load_test"],
    )
    # measuring now: the page says so instead of offering it twice
    body = response.content.decode()
    assert 'id="remeasure-refusal"' in body
    assert "being measured already" in body


def test_it_runs_both_stages_when_both_are_ticked(client, owner, failed_by_gate):
    client.force_login(owner)

    client.post(
        f"/releases/{failed_by_gate.pk}/remeasure/",
        {"stages": ["load_test", "evaluate"], "confirmed": "yes"},
    )

    assert _stored(failed_by_gate).state == "gated"
    assert (_jobs(failed_by_gate, "evaluate"), _jobs(failed_by_gate, "load_test")) == (
        1,
        1,
    )


@pytest.mark.parametrize("confirmed", ["", "yes"])
@pytest.mark.parametrize("stages", [[], ["compress"], ["load_test", "load_test"]])
def test_it_needs_known_stages_each_once(client, member, awaiting, stages, confirmed):
    release = awaiting("1.0.0")
    client.force_login(member)

    response = client.post(
        f"/releases/{release.pk}/remeasure/",
        {"stages": stages, "confirmed": confirmed},
        follow=True,
    )

    assert b"stages must name" in response.content
    assert b"Confirm re-measure" not in response.content
    assert _stored(release).state == "awaiting_approval"
    assert _jobs(release, "load_test") == 1


@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_refuses_a_live_release(client, owner, make_live, confirmed):
    release = make_live("1.0.0")
    client.force_login(owner)

    response = client.post(
        f"/releases/{release.pk}/remeasure/",
        {"stages": ["evaluate"], "confirmed": confirmed},
        follow=True,
    )

    assert b"can be re-measured" in response.content
    assert b"Confirm re-measure" not in response.content
    assert _stored(release).state == "live"
    assert _jobs(release, "evaluate") == 1


def test_it_needs_the_csrf_token(member, awaiting):
    release = awaiting("1.0.0")
    client = Client(enforce_csrf_checks=True)
    client.force_login(member)

    response = client.post(
        f"/releases/{release.pk}/remeasure/",
        {"stages": ["load_test"], "confirmed": "yes"},
    )

    assert response.status_code == 403
    assert _stored(release).state == "awaiting_approval"


@pytest.mark.parametrize("who", ["outsider", "operator"])
@pytest.mark.parametrize("confirmed", ["", "yes"])
def test_it_is_404_for_anyone_outside_the_team(
    client, request, awaiting, who, confirmed
):
    # Neither another team's admin nor a platform operator (staff, in no team) may
    # promote in this team: they see nothing of the release, the form least of all.
    release = awaiting("1.0.0")
    client.force_login(request.getfixturevalue(who))

    page = client.get(f"/releases/{release.pk}/")
    response = client.post(
        f"/releases/{release.pk}/remeasure/",
        {"stages": ["load_test"], "confirmed": confirmed},
    )

    assert page.status_code == 404
    assert b"remeasure" not in page.content
    assert response.status_code == 404
    assert _stored(release).state == "awaiting_approval"
    assert _jobs(release, "load_test") == 1
    assert not AuditEvent.objects.filter(verb="release.remeasure_requested").exists()


def test_it_only_takes_posts(client, member, awaiting):
    release = awaiting("1.0.0")
    client.force_login(member)

    assert client.get(f"/releases/{release.pk}/remeasure/").status_code == 405


def test_it_sends_an_ended_session_to_login(client, awaiting):
    release = awaiting("1.0.0")

    response = client.post(
        f"/releases/{release.pk}/remeasure/", {"stages": ["load_test"]}
    )

    assert response.status_code == 302
    assert "/accounts/login/" in response["Location"]
    assert _stored(release).state == "awaiting_approval"
