"""The API's documented recipe and the agent's Recipe stay one set of options: an
option the agent takes but the API refuses (or the other way round) would be a
recipe CI can't ask for, or one accepted and then refused by the agent."""

from controlplane.api.schemas import RecipeIn
from gpuagent.protocol import Recipe


def test_the_api_recipe_has_the_agents_options_and_defaults():
    assert set(RecipeIn.model_fields) == set(Recipe.model_fields)
    for name, field in Recipe.model_fields.items():
        if not field.is_required():
            assert RecipeIn.model_fields[name].default == field.default, name
