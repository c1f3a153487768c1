from controlplane.audit.models import AuditEvent
from controlplane.releases.models import ModelFamily
from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/models"


def test_it_creates_a_model_family_in_the_tokens_team(api, owner_token, team):
    response = api.post(
        URL, {"name": "qwen-coder", "description": "coding"}, token=owner_token
    )

    assert response.status_code == 201, response.content
    family = ModelFamily.objects.get(pk=response.json()["id"])
    assert (family.team, family.name, family.description) == (
        team,
        "qwen-coder",
        "coding",
    )
    assert response.json()["team"] == "acme"
    assert AuditEvent.objects.filter(verb="model.created", team=team).exists()


def test_it_refuses_a_duplicate_name(api, owner_token, model_family):
    response = api.post(URL, {"name": model_family.name}, token=owner_token)

    assert field_names(error_of(response, 409, "conflict")) == {"name"}


def test_it_allows_the_same_name_in_another_team(api, outsider_token, model_family):
    response = api.post(URL, {"name": model_family.name}, token=outsider_token)

    assert response.status_code == 201, response.content
    assert response.json()["team"] == "other"


def test_it_names_invalid_fields(api, owner_token):
    response = api.post(URL, {"name": "has spaces", "size": 3}, token=owner_token)

    assert field_names(error_of(response, 422, "validation_error")) == {"name", "size"}
    assert not ModelFamily.objects.exists()


def test_it_needs_a_token(api, team):
    error_of(api.post(URL, {"name": "x"}), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, team):
    error_of(api.post(URL, {"name": "x"}, token="rg_nope"), 401, "not_authenticated")


def test_it_needs_the_register_scope(api, approver_token):
    response = api.post(URL, {"name": "x"}, token=approver_token)

    assert error_of(response, 403, "missing_scope")["scope"] == "register"
    assert not ModelFamily.objects.exists()
