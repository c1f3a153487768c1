from controlplane.fleet.models import Deployment
from tests.controlplane.api.helpers import error_of

URL = "/api/v1/environments"


def test_it_lists_environments_with_what_is_live(
    api, owner_token, environment, make_environment, make_release
):
    staging = environment
    make_environment("production")
    live = make_release("1.0.0", state="live", target_environment=staging)
    Deployment.objects.create(release=live, environment=staging, state="live")

    response = api.get(URL, token=owner_token)

    assert response.status_code == 200, response.content
    items = {e["name"]: e for e in response.json()["items"]}
    assert items["staging"]["live_release_id"] == live.pk
    assert items["production"]["live_release_id"] is None
    assert items["staging"]["id"] == staging.pk


def test_it_shows_an_outsider_nothing_of_the_team(api, outsider_token, environment):
    response = api.get(URL, token=outsider_token)

    assert response.json()["items"] == []


def test_it_needs_credentials(api, db):
    error_of(api.get(URL), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, db):
    error_of(api.get(URL, token="rg_nope"), 401, "not_authenticated")


def test_it_needs_the_read_scope(api, make_token, owner):
    response = api.get(URL, token=make_token(owner, "promote"))

    assert error_of(response, 403, "missing_scope")["scope"] == "read"


def test_it_names_a_bad_offset(api, owner_token):
    error = error_of(
        api.get(URL, token=owner_token, offset=-1), 422, "validation_error"
    )

    assert error["fields"][0]["field"] == "offset"
