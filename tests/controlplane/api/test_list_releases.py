from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/releases"


def versions(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [r["version"] for r in response.json()["items"]]


def test_it_lists_the_teams_releases_newest_first(api, owner_token, make_release):
    make_release("1.0.0")
    make_release("1.1.0")

    response = api.get(URL, token=owner_token)

    assert versions(response) == ["1.1.0", "1.0.0"]
    assert response.json()["count"] == 2


def test_it_filters_by_model_state_environment_and_version(
    api, owner_token, make_release, make_model_family, make_environment
):
    other_family = make_model_family("qwen-coder")
    prod = make_environment("production")
    make_release("1.0.0", state="live")
    make_release("1.1.0")
    make_release("1.0.0", family=other_family, target_environment=prod)

    assert versions(api.get(URL, token=owner_token, state="live")) == ["1.0.0"]
    assert versions(api.get(URL, token=owner_token, model="qwen-coder")) == ["1.0.0"]
    by_env = api.get(URL, token=owner_token, environment="production")
    assert [r["model"] for r in by_env.json()["items"]] == ["qwen-coder"]
    by_version = api.get(URL, token=owner_token, version="1.0.0")
    assert sorted(r["model"] for r in by_version.json()["items"]) == [
        "llama-support",
        "qwen-coder",
    ]
    both = api.get(URL, token=owner_token, model="llama-support", state="registered")
    assert versions(both) == ["1.1.0"]


def test_it_paginates(api, owner_token, make_release):
    for minor in range(5):
        make_release(f"1.{minor}.0")

    response = api.get(URL, token=owner_token, limit=2, offset=2)

    data = response.json()
    assert versions(response) == ["1.2.0", "1.1.0"]
    assert (data["count"], data["limit"], data["offset"]) == (5, 2, 2)


def test_it_names_bad_filters(api, owner_token):
    response = api.get(URL, token=owner_token, state="shipped", limit=0)

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"state", "limit"}
    assert {f["location"] for f in error["fields"]} == {"query"}


def test_it_shows_an_outsider_nothing(api, outsider_token, make_release):
    make_release("1.0.0")

    response = api.get(URL, token=outsider_token)

    assert versions(response) == []
    assert response.json()["count"] == 0


def test_it_lets_a_dashboard_user_list(client, owner, make_release):
    make_release("1.0.0")
    client.force_login(owner)

    assert versions(client.get(URL)) == ["1.0.0"]


def test_it_needs_credentials(api, db):
    error_of(api.get(URL), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, owner_token):
    error_of(api.get(URL, token=owner_token[:-1]), 401, "not_authenticated")


def test_it_needs_the_read_scope(api, make_token, owner):
    token = make_token(owner, "register")

    assert error_of(api.get(URL, token=token), 403, "missing_scope")["scope"] == "read"
