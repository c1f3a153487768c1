from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/models"


def names(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [m["name"] for m in response.json()["items"]]


def test_it_lists_the_teams_model_families(
    api, owner_token, make_model_family, other_team
):
    make_model_family("llama-support")
    make_model_family("qwen-coder")
    make_model_family("theirs", of_team=other_team)

    assert names(api.get(URL, token=owner_token)) == ["llama-support", "qwen-coder"]


def test_it_shows_an_outsider_nothing_of_the_team(api, outsider_token, model_family):
    assert names(api.get(URL, token=outsider_token)) == []


def test_it_paginates(api, owner_token, make_model_family):
    for name in ("a", "b", "c"):
        make_model_family(name)

    response = api.get(URL, token=owner_token, limit=1, offset=1)

    assert names(response) == ["b"]
    assert response.json()["count"] == 3


def test_it_names_a_bad_limit(api, owner_token):
    response = api.get(URL, token=owner_token, limit=10_000)

    assert field_names(error_of(response, 422, "validation_error")) == {"limit"}


def test_it_lets_a_dashboard_user_list(client, teammate, model_family):
    client.force_login(teammate)

    assert names(client.get(URL)) == ["llama-support"]


def test_it_needs_credentials(api, db):
    error_of(api.get(URL), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, db):
    error_of(api.get(URL, token="rg_nope"), 401, "not_authenticated")


def test_it_needs_the_read_scope(api, make_token, owner):
    response = api.get(URL, token=make_token(owner, "register"))

    assert error_of(response, 403, "missing_scope")["scope"] == "read"
