import pytest

from controlplane.accounts.actions import (
    check_actor_in_team,
    do_add_member,
    do_create_api_token,
    do_create_team,
    do_create_user,
    do_remove_member,
    do_revoke_api_token,
)
from controlplane.accounts.models import API_SCOPES, ApiToken
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


def test_it_lets_only_staff_create_teams(owner, admin_user):
    with pytest.raises(Forbidden, match="staff or superuser"):
        do_create_team("Shadow", actor=owner)

    team = do_create_team("Search Infra", actor=admin_user, admin=owner)

    assert check_actor_in_team(owner, team, roles=("admin",))


@pytest.mark.parametrize(
    ("who", "allowed"),
    [
        ("member", {"read", "register", "promote"}),
        ("teammate", {"read", "register", "promote", "approve"}),
        ("owner", set(API_SCOPES)),
    ],
)
def test_it_gives_a_token_no_scope_beyond_its_users_role(request, team, who, allowed):
    user = request.getfixturevalue(who)

    for scope in API_SCOPES:
        if scope in allowed:
            assert do_create_api_token(user, team, scope, [scope])[0].scopes == [scope]
        else:
            with pytest.raises(Forbidden, match=f"'{scope}' scope needs"):
                do_create_api_token(user, team, scope, [scope])


def test_it_lets_a_token_grant_only_what_it_holds(team, owner, teammate):
    reader, _ = do_create_api_token(owner, team, "reader", ["read", "admin"])

    with pytest.raises(Forbidden, match="can't grant scopes it lacks: promote"):
        do_create_api_token(owner, team, "ci", ["promote"], actor=reader)
    with pytest.raises(Forbidden, match="needs role admin"):
        do_create_api_token(owner, team, "ci", ["read"], actor=teammate)


def test_it_lets_only_its_user_or_an_admin_revoke_a_token(
    team, owner, teammate, member
):
    token, plaintext = do_create_api_token(member, team, "carol-ci", ["read"])

    with pytest.raises(Forbidden):
        do_revoke_api_token(token, actor=teammate)
    assert ApiToken.lookup(plaintext) == token
    do_revoke_api_token(token, actor=owner)
    assert ApiToken.lookup(plaintext) is None


def test_it_revokes_a_removed_members_tokens_and_keeps_an_admin(team, owner, member):
    _, plaintext = do_create_api_token(member, team, "carol-ci", ["read"])

    do_remove_member(team, member, actor=owner)

    assert ApiToken.lookup(plaintext) is None
    with pytest.raises(Conflict, match="only admin"):
        do_remove_member(team, owner, actor=owner)
    with pytest.raises(Conflict, match="only admin"):
        do_add_member(team, owner, "member", actor=owner)


def test_it_creates_a_user_without_a_password_in_the_team(team, owner):
    user = do_create_user("dave", team=team, role="approver", actor=owner)

    assert not user.has_usable_password()
    assert check_actor_in_team(user, team, roles=("approver",))
    with pytest.raises(Conflict, match="taken"):
        do_create_user("DAVE", team=team, role="member", actor=owner)
