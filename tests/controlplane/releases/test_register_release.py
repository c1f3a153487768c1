import pytest

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent
from controlplane.errors import ConflictingRegistration, Forbidden, ValidationFailed
from controlplane.releases.actions.registration import do_register_release
from controlplane.releases.models import Release
from tests.controlplane.conftest import RECIPE, team_source_uri


def source_uri() -> str:
    return team_source_uri("llama-support/2.0.0")  # made by `_source_folder`


@pytest.fixture(autouse=True)
def _source_folder(make_source):
    return make_source("llama-support/2.0.0")


def register(family, environment, actor, **overrides):
    body = {
        "version": "2.0.0",
        "source_uri": source_uri(),
        "recipe": RECIPE,
        "target_environment": environment,
    }
    body.update(overrides)
    return do_register_release(family, actor=actor, **body)


def test_it_registers_a_release(model_family, environment, owner):
    release, created = register(model_family, environment, owner)

    assert created is True
    assert release.state == "registered"
    assert release.created_by == owner
    assert release.created_by_token is None
    assert release.recipe == RECIPE
    assert len(release.registration_body_digest) == 64
    event = AuditEvent.objects.get(verb="release.registered")
    assert event.after["version"] == "2.0.0"


def test_it_is_idempotent_for_the_same_body(model_family, environment, owner):
    first, _ = register(model_family, environment, owner)

    again, created = register(model_family, environment, owner)

    assert created is False
    assert again.pk == first.pk
    assert Release.objects.count() == 1
    assert AuditEvent.objects.filter(verb="release.registered").count() == 1


def test_it_refuses_a_different_body_for_the_same_version(
    model_family, environment, owner
):
    register(model_family, environment, owner)

    with pytest.raises(ConflictingRegistration) as info:
        register(
            model_family,
            environment,
            owner,
            recipe={"weights": "int8", "kv_cache_dtype": "fp8"},
        )

    assert info.value.code == 409
    assert Release.objects.count() == 1


def test_it_records_the_registering_token(model_family, environment, owner, team):
    token, _ = ApiToken.create(owner, team, "ci", ["register"])

    release, _ = register(model_family, environment, token)

    assert release.created_by == owner
    assert release.created_by_token == token


def test_it_requires_the_register_scope_on_tokens(
    model_family, environment, owner, team
):
    token, _ = ApiToken.create(owner, team, "reader", ["read"])

    with pytest.raises(Forbidden):
        register(model_family, environment, token)


def test_it_refuses_outsiders(model_family, environment, outsider):
    with pytest.raises(Forbidden):
        register(model_family, environment, outsider)

    assert Release.objects.count() == 0


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        ({"weights": "int3", "kv_cache_dtype": "int8"}, "recipe.weights"),
        ({"weights": "int8", "kv_cache_dtype": "int2"}, "recipe.kv_cache_dtype"),
        ({"weights": "int8"}, "recipe.kv_cache_dtype"),
        ({"weights": "int8", "kv_cache_dtype": "int8", "x": 1}, "recipe.x"),
    ],
)
def test_it_names_the_bad_recipe_field(model_family, environment, owner, recipe, field):
    with pytest.raises(ValidationFailed) as info:
        register(model_family, environment, owner, recipe=recipe)

    assert info.value.field == field
    assert info.value.code == 422


def test_it_refuses_an_environment_of_another_team(
    model_family, make_environment, other_team, owner
):
    foreign = make_environment("production", of_team=other_team)

    with pytest.raises(ValidationFailed) as info:
        register(model_family, foreign, owner)

    assert info.value.field == "target_environment"


@pytest.mark.parametrize(("field", "value"), [("version", " "), ("source_uri", "")])
def test_it_refuses_empty_fields(model_family, environment, owner, field, value):
    with pytest.raises(ValidationFailed) as info:
        register(model_family, environment, owner, **{field: value})

    assert info.value.field == field
