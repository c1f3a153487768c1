def test_it_redirects_anonymous_users_to_login(client, release):
    response = client.get("/")

    assert response.status_code == 302
    assert response.url.startswith("/accounts/login/")


def test_it_lists_the_team_releases(client, owner, make_release):
    first = make_release("1.0.0")
    second = make_release("2.0.0", state="live")
    client.force_login(owner)

    response = client.get("/")

    assert response.status_code == 200
    assert f"/releases/{first.pk}/".encode() in response.content
    assert f"/releases/{second.pk}/".encode() in response.content


def test_it_filters_by_state(client, owner, make_release):
    make_release("1.0.0")
    live = make_release("2.0.0", state="live")
    client.force_login(owner)

    response = client.get("/?state=live")

    assert [r.pk for r in response.context["releases"]] == [live.pk]


def test_it_shows_outsiders_nothing(client, outsider, release, environment):
    client.force_login(outsider)

    response = client.get("/")

    assert response.status_code == 200
    assert list(response.context["releases"]) == []
    assert response.context["environments"] == []
    assert str(release).encode() not in response.content
