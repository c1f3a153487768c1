"""POST /api/v1/environments: a team's admin adds an environment to the token's
team (do_create_environment: admin role, audited)."""

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Environment
from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/environments"


def test_it_creates_an_environment_in_the_tokens_team(api, admin_token, team):
    response = api.post(URL, {"name": "production"}, token=admin_token)

    assert response.status_code == 201, response.content
    environment = Environment.objects.get(name="production")
    assert environment.team == team
    assert response.json() == {
        "id": environment.pk,
        "team": "acme",
        "name": "production",
        "live_release_id": None,
        "rollback_target": None,
    }
    assert AuditEvent.objects.get(verb="environment.created").team == team
    listed = api.get(URL, token=admin_token).json()["items"]
    assert [e["name"] for e in listed] == ["production"]


def test_it_refuses_a_taken_or_bad_name(api, admin_token, environment):
    taken = api.post(URL, {"name": "staging"}, token=admin_token)
    bad = api.post(URL, {"name": "prod/eu"}, token=admin_token)

    assert field_names(error_of(taken, 409, "conflict")) == {"name"}
    assert field_names(error_of(bad, 422, "validation_error")) == {"name"}
    assert Environment.objects.count() == 1


def test_it_needs_the_admin_role(api, make_token, teammate):
    response = api.post(URL, {"name": "x"}, token=make_token(teammate, "admin"))

    error_of(response, 403, "forbidden")
    assert not Environment.objects.exists()


def test_it_puts_the_outsiders_environment_in_their_own_team(
    api, outsider_token, other_team, team
):
    response = api.post(URL, {"name": "sandbox"}, token=outsider_token)

    assert response.status_code == 201, response.content
    assert Environment.objects.get(name="sandbox").team == other_team
