from controlplane.releases.actions import (
    do_finish_job,
    do_record_gate_result,
    do_start_job,
)


def test_it_shows_state_jobs_gates_approvals_and_deployments(
    client, teammate, make_release
):
    release = make_release(state="live", manifest_digest="sha256:" + "ab" * 32)
    do_finish_job(do_start_job(release, "compress"), result={})
    do_record_gate_result(
        release,
        gate="quality",
        metric="perplexity_ratio",
        observed=1.01,
        threshold=1.03,
        outcome="pass",
    )
    release.approvals.create(user=teammate, decision="approve", manifest_digest="d1")
    release.deployments.create(environment=release.target_environment, state="live")
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    body = response.content.decode()
    assert response.status_code == 200
    assert "state-live" in body
    assert "compress" in body
    assert "perplexity_ratio" in body
    assert "d1" in body
    assert "ab" * 32 in body
    assert "Not deployed" not in body


def test_it_offers_the_decision_to_an_approver(client, teammate, make_release):
    release = make_release(state="awaiting_approval")
    client.force_login(teammate)

    response = client.get(f"/releases/{release.pk}/")

    assert response.context["can_decide"] is True
    assert f"/releases/{release.pk}/approve/".encode() in response.content


def test_it_hides_the_decision_from_the_registering_user(client, owner, release):
    type(release).objects.filter(pk=release.pk).update(state="awaiting_approval")
    client.force_login(owner)

    response = client.get(f"/releases/{release.pk}/")

    assert response.context["can_decide"] is False
    assert b"/approve/" not in response.content


def test_it_hides_the_decision_from_members(client, member, make_release):
    release = make_release(state="awaiting_approval")
    client.force_login(member)

    response = client.get(f"/releases/{release.pk}/")

    assert response.context["can_decide"] is False


def test_it_is_404_for_outsiders(client, outsider, release):
    client.force_login(outsider)

    assert client.get(f"/releases/{release.pk}/").status_code == 404


def test_it_is_404_for_missing_releases(client, owner, db):
    client.force_login(owner)

    assert client.get("/releases/999999/").status_code == 404


def test_it_shows_the_release_history(client, owner, release):
    from controlplane.releases.actions import do_transition_release

    do_transition_release(release, "failed", actor=owner, reason="disk full")
    client.force_login(owner)

    response = client.get(f"/releases/{release.pk}/")

    verbs = [e.verb for e in response.context["history"]]
    assert verbs == ["release.registered", "release.transition"]
    assert b"disk full" in response.content
