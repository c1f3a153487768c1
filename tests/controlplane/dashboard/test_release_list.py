from controlplane.releases.actions.jobs import do_start_job
from controlplane.releases.models import Release


def _listed(response) -> list[int]:
    return [release.pk for release in response.context["releases"]]


def test_it_redirects_anonymous_users_to_login(client, release):
    response = client.get("/")

    assert response.status_code == 302
    assert response.url.startswith("/accounts/login/")


def test_it_lists_the_team_releases_with_state_badges(client, owner, make_release):
    first = make_release("1.0.0")
    second = make_release("2.0.0", state="live")
    client.force_login(owner)

    response = client.get("/")

    body = response.content.decode()
    assert response.status_code == 200
    assert _listed(response) == [second.pk, first.pk]
    assert f'href="/releases/{first.pk}/"' in body
    assert '<span class="state state-live">live</span>' in body
    assert (
        '<meta name="viewport" content="width=device-width, initial-scale=1">' in body
    )


def test_it_filters_by_state(client, owner, make_release):
    make_release("1.0.0")
    live = make_release("2.0.0", state="live")
    client.force_login(owner)

    assert _listed(client.get("/?state=live")) == [live.pk]


def test_it_filters_by_model_and_environment(
    client, owner, make_release, make_model_family, make_environment
):
    other_family = make_model_family("glm-search")
    production = make_environment("production")
    make_release("1.0.0")
    wanted = make_release("1.0.1", family=other_family, target_environment=production)
    make_release("1.0.2", family=other_family)
    client.force_login(owner)

    response = client.get(
        f"/?model={other_family.pk}&environment={production.pk}&state="
    )

    assert _listed(response) == [wanted.pk]


def test_it_refuses_an_unknown_state_naming_it(client, owner, release):
    client.force_login(owner)

    response = client.get("/?state=bogus")

    assert response.status_code == 400
    assert _listed(response) == []
    assert (
        b"Select a valid choice. bogus is not one of the available" in response.content
    )


def test_it_refuses_another_teams_model_as_a_filter(
    client, outsider, release, model_family
):
    client.force_login(outsider)

    response = client.get(f"/?model={model_family.pk}")

    assert response.status_code == 400
    assert _listed(response) == []


def test_it_pages_the_list(client, owner, make_release):
    releases = [make_release(f"1.0.{n}") for n in range(27)]
    client.force_login(owner)

    first = client.get("/?state=registered")
    second = client.get("/?state=registered&page=2")

    assert _listed(first) == [r.pk for r in reversed(releases)][:25]
    assert _listed(second) == [releases[1].pk, releases[0].pk]
    assert b"Page 1 of 2 (27)" in first.content
    assert b'href="?state=registered&amp;page=2"' in first.content


def test_it_shows_running_pipelines_with_stuck_and_retried_jobs(
    client, owner, make_release, agent, expire_lease
):
    running = make_release("1.1.0", state="evaluating")
    stuck = do_start_job(running, "evaluate", agent=agent)
    expire_lease(stuck)
    retried = do_start_job(running, "load_test")
    expire_lease(retried)
    do_start_job(running, "load_test")
    make_release("1.2.0", state="live")
    client.force_login(owner)

    response = client.get("/")

    pipelines = response.context["pipelines"]
    assert [row["release"].pk for row in pipelines] == [running.pk]
    health = {s.kind: s.health for s in pipelines[0]["stages"]}
    assert (health["evaluate"].stuck, health["evaluate"].retried) == (True, False)
    assert (health["load_test"].stuck, health["load_test"].retried) == (False, True)
    body = response.content.decode()
    assert "state-stuck" in body and "state-retried" in body
    assert "its worker stopped renewing it" in body
    assert "attempt 2: 1 earlier attempt(s) did not finish" in body


def test_it_shows_outsiders_nothing(client, outsider, make_release):
    release = make_release("1.0.0", state="evaluating")
    client.force_login(outsider)

    response = client.get("/")

    assert response.status_code == 200
    assert _listed(response) == []
    assert response.context["pipelines"] == []
    assert str(release).encode() not in response.content
    assert Release.objects.count() == 1
