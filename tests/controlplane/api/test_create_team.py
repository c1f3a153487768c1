"""POST /api/v1/teams: the site's operators (staff or superuser accounts) make
teams; a team admin manages their own and makes none."""

import pytest

from controlplane.accounts.models import Membership, Team
from controlplane.audit.models import AuditEvent
from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/teams"


@pytest.fixture
def staff_owner(owner):
    owner.is_staff = True
    owner.save(update_fields=["is_staff"])
    return owner


def test_it_creates_a_team_with_the_caller_as_its_admin(api, admin_token, staff_owner):
    response = api.post(URL, {"name": "Search Infra"}, token=admin_token)

    assert response.status_code == 201, response.content
    created = response.json()
    team = Team.objects.get(slug="search-infra")
    assert created == {"id": team.pk, "name": "Search Infra", "slug": "search-infra"}
    assert Membership.objects.get(team=team).user == staff_owner
    assert Membership.objects.get(team=team).role == "admin"
    verbs = set(AuditEvent.objects.filter(team=team).values_list("verb", flat=True))
    assert verbs == {"team.created", "team.member_set"}
    assert AuditEvent.objects.get(verb="team.created").actor_user == staff_owner


def test_it_makes_the_named_user_its_admin(api, admin_token, staff_owner, teammate):
    body = {"name": "Ranking", "slug": "ranking-ml", "admin": "bob"}

    response = api.post(URL, body, token=admin_token)

    assert response.status_code == 201, response.content
    membership = Membership.objects.get(team__slug="ranking-ml")
    assert (membership.user, membership.role) == (teammate, "admin")


def test_it_refuses_a_team_admin_who_is_not_staff(api, admin_token, owner):
    response = api.post(URL, {"name": "Shadow"}, token=admin_token)

    assert "staff" in error_of(response, 403, "forbidden")["message"]
    assert not Team.objects.filter(name="Shadow").exists()


def test_it_needs_the_admin_scope(api, make_token, staff_owner):
    response = api.post(URL, {"name": "X"}, token=make_token(staff_owner, "read"))

    assert error_of(response, 403, "missing_scope")["scope"] == "admin"
    assert not Team.objects.filter(name="X").exists()


def test_it_refuses_a_taken_slug_and_an_unknown_admin(api, admin_token, staff_owner):
    taken = api.post(URL, {"name": "Acme", "slug": "acme"}, token=admin_token)
    unknown = api.post(URL, {"name": "Y", "admin": "nobody"}, token=admin_token)

    assert field_names(error_of(taken, 409, "conflict")) == {"slug"}
    assert field_names(error_of(unknown, 422, "validation_failed")) == {"admin"}
    assert Team.objects.count() == 1


def test_it_needs_credentials(api, db):
    error_of(api.post(URL, {"name": "Z"}), 401, "not_authenticated")
