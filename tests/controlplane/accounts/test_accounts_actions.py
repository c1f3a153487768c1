import pytest

from controlplane.accounts.actions import (
    check_actor_in_team,
    do_add_member,
    do_create_api_token,
    do_create_team,
    do_revoke_api_token,
)
from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict, Forbidden, ValidationFailed


def test_it_creates_a_team_once(db):
    team = do_create_team("Search Infra")

    assert team.slug == "search-infra"
    with pytest.raises(Conflict):
        do_create_team("Search Infra")


def test_it_sets_a_member_role_and_audits_it(team, member, owner):
    do_add_member(team, member, "approver", actor=owner)

    assert check_actor_in_team(member, team, roles=("approver",)).role == "approver"
    event = AuditEvent.objects.get(verb="team.member_set")
    assert event.before == {"role": "member"}
    assert event.after["role"] == "approver"


def test_it_refuses_unknown_roles(team, member):
    with pytest.raises(ValidationFailed):
        do_add_member(team, member, "superuser")


def test_it_checks_team_membership(team, owner, outsider):
    assert check_actor_in_team(owner, team).role == "admin"
    with pytest.raises(Forbidden):
        check_actor_in_team(outsider, team)


def test_it_checks_token_team_and_scope(team, other_team, owner, outsider):
    token, _ = do_create_api_token(owner, team, "ci", ["read"])
    foreign, _ = do_create_api_token(outsider, other_team, "ci", ["read", "promote"])

    assert check_actor_in_team(token, team, scope="read")
    with pytest.raises(Forbidden):
        check_actor_in_team(token, team, scope="promote")
    with pytest.raises(Forbidden):
        check_actor_in_team(foreign, team, scope="read")


def test_it_creates_tokens_only_for_members(team, owner, outsider):
    token, plaintext = do_create_api_token(owner, team, "ci", ["read"])

    assert ApiToken.lookup(plaintext) == token
    assert AuditEvent.objects.get(verb="api_token.created").object_id == str(token.pk)
    with pytest.raises(Forbidden):
        do_create_api_token(outsider, team, "ci", ["read"])


def test_it_revokes_a_token(team, owner):
    token, plaintext = do_create_api_token(owner, team, "ci", ["read"])

    do_revoke_api_token(token, actor=owner)

    assert ApiToken.lookup(plaintext) is None
    with pytest.raises(Forbidden):
        check_actor_in_team(ApiToken.objects.get(pk=token.pk), team)
