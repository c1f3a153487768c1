from datetime import timedelta

from django.utils import timezone

from controlplane.releases.actions.transitions import do_transition_release


def _verbs(response) -> list[str]:
    return [event.verb for event in response.context["page"].object_list]


def test_it_lists_the_teams_events_newest_first(client, owner, release):
    do_transition_release(release, "failed", actor=owner, reason="disk full")
    client.force_login(owner)

    response = client.get("/audit/")

    assert response.status_code == 200
    assert _verbs(response) == ["release.transition", "release.registered"]
    assert b"disk full" in response.content


def test_it_filters_by_verb_actor_object_and_time(client, owner, teammate, release):
    do_transition_release(release, "failed", actor=teammate, reason="disk full")
    client.force_login(owner)
    now = timezone.now()
    later = (now + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M")
    earlier = (now - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M")

    assert _verbs(client.get("/audit/?verb=transition")) == ["release.transition"]
    assert _verbs(client.get("/audit/?actor=bob")) == ["release.transition"]
    assert _verbs(client.get("/audit/?object_type=release")) == [
        "release.transition",
        "release.registered",
    ]
    assert _verbs(client.get(f"/audit/?since={later}")) == []
    assert len(_verbs(client.get(f"/audit/?since={earlier}&until={later}"))) == 2


def test_it_refuses_a_backwards_time_range(client, owner, release):
    client.force_login(owner)

    response = client.get("/audit/?since=2026-01-02T00:00&until=2026-01-01T00:00")

    assert response.status_code == 400
    assert _verbs(response) == []
    assert b"&#x27;since&#x27; must be before &#x27;until&#x27;" in response.content


def test_it_pages_the_log(client, owner, make_release):
    for n in range(51):
        make_release(f"1.0.{n}")
    client.force_login(owner)

    assert len(_verbs(client.get("/audit/?object_type=release"))) == 50
    assert len(_verbs(client.get("/audit/?object_type=release&page=2"))) == 1


def test_it_shows_outsiders_none_of_the_teams_events(client, outsider, release):
    client.force_login(outsider)

    response = client.get("/audit/")

    assert _verbs(response) == []
    assert str(release).encode() not in response.content
    assert client.get(f"/audit/?team={release.team.pk}").status_code == 400
