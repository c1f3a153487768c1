import importlib
from collections import deque

import pytest
from django.apps import apps
from django.db.models import QuerySet

from controlplane.audit.models import AuditEvent
from controlplane.errors import IllegalTransition, ValidationFailed
from controlplane.releases.actions import transitions
from controlplane.releases.actions.transitions import (
    REASON_REQUIRED,
    TRANSITIONS,
    do_transition_release,
)
from controlplane.releases.models import RELEASE_STATES, Release


def erase_audit_log() -> None:
    """Delete every audit event, as only someone with the database could (the
    model refuses it): what the code under test decides must not change."""
    QuerySet.delete(AuditEvent.objects.all())


LEGAL = [(a, b) for a in RELEASE_STATES for b in RELEASE_STATES if b in TRANSITIONS[a]]
ILLEGAL = [
    (a, b) for a in RELEASE_STATES for b in RELEASE_STATES if b not in TRANSITIONS[a]
]


def test_it_has_a_table_row_for_every_state_and_no_dead_end():
    assert set(TRANSITIONS) == set(RELEASE_STATES)
    assert all(TRANSITIONS[state] for state in RELEASE_STATES)


def test_it_can_reach_every_state_from_registered():
    seen, todo = {"registered"}, deque(["registered"])
    while todo:
        for target in TRANSITIONS[todo.popleft()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    assert seen == set(RELEASE_STATES)


def test_it_can_get_back_to_registered_or_live_from_every_state():
    # No release is stuck: from anywhere there is a path to a fresh start or to live.
    def reachable(start):
        seen, todo = {start}, deque([start])
        while todo:
            for target in TRANSITIONS[todo.popleft()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    for state in RELEASE_STATES:
        assert reachable(state) & {"registered", "live"}, state


@pytest.mark.parametrize(("from_state", "to_state"), LEGAL)
def test_it_allows_legal_transition(make_release, owner, from_state, to_state):
    release = make_release(state=from_state)
    reason = "because" if to_state in REASON_REQUIRED else ""

    do_transition_release(release, to_state, actor=owner, reason=reason)

    stored = Release.objects.get(pk=release.pk)
    assert stored.state == to_state == release.state
    event = AuditEvent.objects.filter(verb="release.transition").get()
    assert event.object_id == str(release.pk)
    assert event.before == {"state": from_state}
    assert event.after == {"state": to_state, "reason": reason}
    assert event.actor_user == owner
    assert event.team == release.team


@pytest.mark.parametrize(("from_state", "to_state"), ILLEGAL)
def test_it_refuses_illegal_transition(make_release, owner, from_state, to_state):
    release = make_release(state=from_state)
    events_before = AuditEvent.objects.count()

    with pytest.raises(IllegalTransition) as info:
        do_transition_release(release, to_state, actor=owner, reason="x")

    message = str(info.value)
    assert f"{from_state} -> {to_state}" in message
    for target in TRANSITIONS[from_state]:
        assert target in message
    assert Release.objects.get(pk=release.pk).state == from_state
    assert AuditEvent.objects.count() == events_before


def test_it_checks_the_state_in_the_database_not_the_object(release, owner):
    Release.objects.filter(pk=release.pk).update(state="live")  # moved elsewhere

    with pytest.raises(IllegalTransition):
        do_transition_release(release, "verifying", actor=owner)


@pytest.mark.parametrize("to_state", REASON_REQUIRED)
def test_it_requires_a_reason_for_failure_states(make_release, owner, to_state):
    from_state = next(s for s in RELEASE_STATES if to_state in TRANSITIONS[s])
    release = make_release(state=from_state)

    with pytest.raises(ValidationFailed):
        do_transition_release(release, to_state, actor=owner)

    assert Release.objects.get(pk=release.pk).state == from_state


def test_it_keeps_the_failure_reason_and_clears_it_on_retry(release, owner):
    do_transition_release(release, "failed", actor=owner, reason="disk full")
    assert Release.objects.get(pk=release.pk).failure_reason == "disk full"

    do_transition_release(release, "registered", actor=owner)

    assert Release.objects.get(pk=release.pk).failure_reason == ""


def test_it_rejects_unknown_states(release, owner):
    with pytest.raises(ValidationFailed):
        do_transition_release(release, "exploded", actor=owner)


def test_it_changes_nothing_when_the_audit_write_fails(release, owner, monkeypatch):
    def broken_audit(*args, **kwargs):
        raise RuntimeError("audit store down")

    monkeypatch.setattr(transitions, "do_record_event", broken_audit)

    with pytest.raises(RuntimeError):
        do_transition_release(release, "verifying", actor=owner)

    assert Release.objects.get(pk=release.pk).state == "registered"
    assert not AuditEvent.objects.filter(verb="release.transition").exists()


def test_it_names_a_token_actor_in_the_audit_event(release, owner, team):
    from controlplane.accounts.models import ApiToken

    token, _ = ApiToken.create(owner, team, "ci", ["promote"])

    do_transition_release(release, "verifying", actor=token)

    event = AuditEvent.objects.get(verb="release.transition")
    assert event.actor_token == token
    assert event.actor_user == owner
    assert event.actor_name == f"token:{token.prefix} (ci, alice)"


def test_it_keeps_when_the_release_entered_its_state_and_was_reopened(release, owner):
    do_transition_release(release, "failed", actor=owner, reason="disk full")
    failed = Release.objects.get(pk=release.pk)
    assert failed.state_entered_at > release.created
    assert failed.reopened_at is None

    do_transition_release(release, "registered", actor=owner)

    stored = Release.objects.get(pk=release.pk)
    assert stored.state_entered_at > failed.state_entered_at
    assert stored.reopened_at == stored.state_entered_at
    assert (release.state_entered_at, release.reopened_at) == (
        stored.state_entered_at,
        stored.reopened_at,
    )


def test_the_migration_fills_them_from_the_audit_log(make_release, owner):
    migration = importlib.import_module(
        "controlplane.releases.migrations.0004_release_state_entered_at"
    )
    reopened, untouched = make_release(), make_release()
    do_transition_release(reopened, "failed", actor=owner, reason="disk full")
    do_transition_release(reopened, "registered", actor=owner)
    do_transition_release(reopened, "verifying", actor=owner)
    events = AuditEvent.objects.filter(verb="release.transition").order_by("id")
    Release.objects.update(state_entered_at=untouched.created, reopened_at=None)

    migration.fill_from_audit_log(apps, None)

    stored = Release.objects.get(pk=reopened.pk)
    assert stored.state_entered_at == events[2].created
    assert stored.reopened_at == events[1].created
    assert Release.objects.get(pk=untouched.pk).state_entered_at == untouched.created
