"""POST /api/v1/users: a team's admin makes an account for a newcomer, a member
of the team, without a password; the newcomer sets one through the one-time link
in the answer and can then sign in to the dashboard."""

from urllib.parse import urlsplit

from django.contrib.auth.models import User

from controlplane.accounts.models import Membership
from controlplane.audit.models import AuditEvent
from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/users"
NEW_PASSWORD = "a-long-enough-new-passphrase"


def test_it_creates_a_member_who_sets_a_password_once(api, client, admin_token, team):
    body = {"username": "dave", "email": "dave@example.org", "team": "acme"}

    response = api.post(URL, body, token=admin_token)

    assert response.status_code == 201, response.content
    created = response.json()
    assert {k: created[k] for k in ("team", "user", "role", "email")} == {
        "team": "acme",
        "user": "dave",
        "role": "member",
        "email": "dave@example.org",
    }
    dave = User.objects.get(username="dave")
    assert not dave.has_usable_password()
    assert Membership.objects.get(user=dave).team == team
    assert AuditEvent.objects.filter(verb="user.created", team=team).count() == 1
    # The link: Django's reset confirmation redirects to its set-password form.
    link = urlsplit(created["set_password_url"]).path
    form = client.get(link, follow=True)
    assert form.status_code == 200
    done = client.post(
        form.redirect_chain[-1][0],
        {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD},
    )
    assert done.status_code == 302
    assert client.login(username="dave", password=NEW_PASSWORD)
    again = client.get(link, follow=True)
    assert "invalid" in again.content.decode().lower()  # one time only


def test_it_refuses_a_team_that_is_not_the_callers(api, outsider_token, team):
    body = {"username": "eve", "team": "acme"}

    response = api.post(URL, body, token=outsider_token)

    assert field_names(error_of(response, 422, "validation_failed")) == {"team"}
    assert not User.objects.filter(username="eve").exists()


def test_it_needs_the_admin_role(api, make_token, teammate):
    token = make_token(teammate, "admin")

    response = api.post(URL, {"username": "eve", "team": "acme"}, token=token)

    error_of(response, 403, "forbidden")
    assert not User.objects.filter(username="eve").exists()


def test_it_refuses_a_taken_or_bad_username(api, admin_token, teammate):
    taken = api.post(URL, {"username": "Bob", "team": "acme"}, token=admin_token)
    bad = api.post(URL, {"username": "a b", "team": "acme"}, token=admin_token)
    email = api.post(
        URL, {"username": "x", "team": "acme", "email": "no"}, token=admin_token
    )

    assert field_names(error_of(taken, 409, "conflict")) == {"username"}
    assert field_names(error_of(bad, 422, "validation_error")) == {"username"}
    assert field_names(error_of(email, 422, "validation_failed")) == {"email"}
