import pytest

from controlplane.audit.models import AuditEvent
from controlplane.releases.models import Release
from tests.controlplane.api.helpers import error_of, field_names
from tests.controlplane.conftest import team_source_uri

URL = "/api/v1/releases"


def source_uri() -> str:
    return team_source_uri("llama-support/2.0.0")  # made by `_source_folder`


@pytest.fixture(autouse=True)
def _source_folder(make_source):
    return make_source("llama-support/2.0.0")


def body(**overrides) -> dict:
    data = {
        "model": "llama-support",
        "version": "2.0.0",
        "source_uri": source_uri(),
        "recipe": {"weights": "int4-g128", "kv_cache_dtype": "int8"},
        "target_environment": "staging",
    }
    data.update(overrides)
    return data


def test_it_registers_a_release(api, owner, owner_token, model_family, environment):
    response = api.post(URL, body(), token=owner_token)

    assert response.status_code == 201, response.content
    data = response.json()
    release = Release.objects.get(pk=data["id"])
    assert (release.model, release.version) == (model_family, "2.0.0")
    assert release.target_environment == environment
    assert release.recipe == {"weights": "int4-g128", "kv_cache_dtype": "int8"}
    assert release.created_by == owner
    assert release.created_by_token.prefix == owner_token[:8]
    assert data["state"] == "registered"
    assert response["Location"].endswith(f"/api/v1/releases/{release.pk}")
    assert AuditEvent.objects.filter(
        verb="release.registered", object_id=str(release.pk)
    ).exists()


def test_it_returns_the_existing_release_for_the_same_body(
    api, owner_token, model_family, environment
):
    first = api.post(URL, body(), token=owner_token)
    again = api.post(URL, body(), token=owner_token)

    assert first.status_code == 201
    assert again.status_code == 200, again.content
    assert again.json()["id"] == first.json()["id"]
    assert Release.objects.filter(version="2.0.0").count() == 1


def test_it_refuses_a_conflicting_reregistration(
    api, owner_token, model_family, environment
):
    api.post(URL, body(), token=owner_token)

    response = api.post(
        URL,
        body(recipe={"weights": "int8", "kv_cache_dtype": "fp8"}),
        token=owner_token,
    )

    error_of(response, 409, "conflicting_registration")
    assert Release.objects.get(version="2.0.0").recipe["weights"] == "int4-g128"


def test_it_needs_a_token(api, model_family, environment):
    error_of(api.post(URL, body()), 401, "not_authenticated")
    assert not Release.objects.exists()


def test_it_rejects_a_bad_token(api, owner_token, model_family, environment):
    response = api.post(URL, body(), token=owner_token + "x")

    error_of(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_it_needs_the_register_scope(api, make_token, owner, model_family, environment):
    token = make_token(owner, "read", "promote")

    error = error_of(api.post(URL, body(), token=token), 403, "missing_scope")

    assert error["scope"] == "register"
    assert not Release.objects.exists()


def test_it_names_missing_and_invalid_fields(
    api, owner_token, model_family, environment
):
    data = body(recipe={"weights": "int3", "kv_cache_dtype": "int8"})
    del data["version"]

    error = error_of(api.post(URL, data, token=owner_token), 422, "validation_error")

    assert field_names(error) == {"version", "recipe.weights"}
    assert all(f["location"] == "body" for f in error["fields"])


def test_it_rejects_unknown_keys(api, owner_token, model_family, environment):
    response = api.post(URL, body(weights="int4"), token=owner_token)

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"weights"}


def test_it_takes_values_only_as_the_json_types_the_schema_says(
    api, owner_token, model_family, environment, release
):
    recipe = {"weights": "int4-g128", "kv_cache_dtype": "int8", "symmetric": 0}

    response = api.post(
        URL, body(recipe=recipe, parent=str(release.pk)), token=owner_token
    )

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"recipe.symmetric", "parent"}
    assert not Release.objects.filter(version="2.0.0").exists()


def test_it_stores_an_moe_recipes_min_expert_tokens(
    api, owner_token, model_family, environment
):
    recipe = {
        "weights": "int4-g128",
        "kv_cache_dtype": "int8",
        "method": "gptq",
        "min_expert_tokens": 16,
    }

    response = api.post(URL, body(recipe=recipe), token=owner_token)

    assert response.status_code == 201, response.content
    assert Release.objects.get(version="2.0.0").recipe == recipe


@pytest.mark.parametrize("value", [0, "16", 16.5, True])
def test_it_names_a_min_expert_tokens_that_is_not_a_positive_integer(
    api, owner_token, model_family, environment, value
):
    recipe = {"weights": "int4-g128", "kv_cache_dtype": "int8", "method": "gptq"}

    response = api.post(
        URL, body(recipe=recipe | {"min_expert_tokens": value}), token=owner_token
    )

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"recipe.min_expert_tokens"}
    assert not Release.objects.filter(version="2.0.0").exists()


def test_it_stores_a_recipes_int8_head(api, owner_token, model_family, environment):
    recipe = {"weights": "w4a16-g128", "kv_cache_dtype": "int8", "head": "int8"}

    response = api.post(URL, body(recipe=recipe), token=owner_token)

    assert response.status_code == 201, response.content
    assert Release.objects.get(version="2.0.0").recipe == recipe
    assert response.json()["recipe"]["head"] == "int8"


# the schema's 422 names a value it doesn't take; the action's (through
# gpuagent.protocol.Recipe) a value that doesn't fit the weights, saying why
@pytest.mark.parametrize(
    ("weights", "head", "code", "says"),
    [
        ("w4a16-g128", "int4", "validation_error", "int8"),  # the one offered
        ("w4a16-g128", "Q8_0", "validation_error", "int8"),
        ("w4a16-g128", 8, "validation_error", "int8"),
        ("bf16", "int8", "validation_failed", "needs quantized weights"),
        ("fp8", "int8", "validation_failed", "int weight formats"),
    ],
)
def test_it_names_a_head_it_cannot_write(
    api, owner_token, model_family, environment, weights, head, code, says
):
    recipe = {"weights": weights, "kv_cache_dtype": "int8", "head": head}

    response = api.post(URL, body(recipe=recipe), token=owner_token)

    error = error_of(response, 422, code)
    assert field_names(error) == {"recipe.head"}
    assert says in response.content.decode()
    assert not Release.objects.filter(version="2.0.0").exists()


def test_it_names_a_head_beside_quantize_lm_head(
    api, owner_token, model_family, environment
):
    recipe = {
        "weights": "w8a16",
        "kv_cache_dtype": "int8",
        "quantize_lm_head": True,
        "head": "int8",
    }

    response = api.post(URL, body(recipe=recipe), token=owner_token)

    error = error_of(response, 422, "validation_failed")
    assert field_names(error) == {"recipe.head"}
    assert "give one" in response.content.decode()


def test_it_rejects_a_body_that_is_not_json(api, owner_token, model_family):
    response = api.post(URL, raw="{not json", token=owner_token)

    error_of(response, 400, "bad_request")


def test_it_rejects_a_json_body_that_is_not_an_object(api, owner_token):
    response = api.post(URL, ["model"], token=owner_token)

    error = error_of(response, 422, "validation_error")
    assert [(f["field"], f["location"]) for f in error["fields"]] == [("", "body")]


def test_it_names_an_unknown_model(api, owner_token, environment):
    response = api.post(URL, body(model="nope"), token=owner_token)

    assert field_names(error_of(response, 422, "validation_error")) == {"model"}


def test_it_names_an_unknown_environment(api, owner_token, model_family):
    response = api.post(URL, body(target_environment="prod"), token=owner_token)

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"target_environment"}


def test_it_does_not_let_an_outsider_register_into_the_team(
    api, outsider_token, model_family, environment
):
    response = api.post(URL, body(), token=outsider_token)

    # The outsider's team has no such model: the team's family is invisible to it.
    assert field_names(error_of(response, 422, "validation_error")) == {"model"}
    assert not Release.objects.exists()


def test_it_registers_a_child_of_a_parent_release(
    api, owner_token, release, environment
):
    response = api.post(URL, body(parent=release.pk), token=owner_token)

    assert response.status_code == 201, response.content
    assert response.json()["parent_id"] == release.pk


def test_it_names_a_parent_of_another_team(
    api, outsider_token, outsider, other_team, release
):
    from controlplane.fleet.models import Environment
    from controlplane.releases.models import ModelFamily

    ModelFamily.objects.create(team=other_team, name="llama-support")
    Environment.objects.create(team=other_team, name="staging")

    response = api.post(URL, body(parent=release.pk), token=outsider_token)

    assert field_names(error_of(response, 422, "validation_error")) == {"parent"}


def test_it_refuses_a_source_outside_the_teams_roots(
    api, owner_token, model_family, environment
):
    response = api.post(URL, body(source_uri="file:///etc/ssl"), token=owner_token)

    error = error_of(response, 422, "validation_failed")
    assert field_names(error) == {"source_uri"}
    assert "/etc/ssl is outside your team's source roots" in error["message"]
    assert not Release.objects.exists()


def test_it_refuses_another_teams_folder(
    api, owner_token, model_family, environment, make_source
):
    theirs = make_source("their-model", {"config.json": "{}"}, team="other")

    response = api.post(URL, body(source_uri=theirs.as_uri()), token=owner_token)

    error = error_of(response, 422, "validation_failed")
    assert "outside your team's source roots" in error["message"]


def test_it_refuses_a_symlink_out_of_the_teams_folder(
    api, owner_token, model_family, environment, make_source
):
    theirs = make_source("their-model", team="other")
    link = make_source("innocent").parent / "link"
    link.symlink_to(theirs)

    response = api.post(URL, body(source_uri=link.as_uri()), token=owner_token)

    error = error_of(response, 422, "validation_failed")
    assert "link in" in error["message"] and "is a symlink" in error["message"]


def test_it_refuses_dot_dot_and_remote_schemes(
    api, owner_token, model_family, environment
):
    escape = source_uri().replace("/2.0.0", "/../../other/x")
    for uri, problem in ((escape, "'..'"), ("s3://bucket/m", "scheme 's3'")):
        response = api.post(URL, body(source_uri=uri), token=owner_token)

        assert problem in error_of(response, 422, "validation_failed")["message"]
