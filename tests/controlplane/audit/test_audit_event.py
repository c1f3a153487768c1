import pytest

from controlplane.accounts.models import TOKEN_PREFIX_LENGTH, ApiToken
from controlplane.audit.actions import do_record_event, on_behalf_of_agent
from controlplane.audit.models import AppendOnlyError, AuditEvent


@pytest.fixture
def event(release, owner):
    return do_record_event(owner, "release.poked", release, after={"x": 1})


def test_it_records_actor_verb_and_object(event, release, owner):
    assert event.actor_name == owner.username
    assert (event.object_type, event.object_id) == ("release", str(release.pk))
    assert event.to_dict()["after"] == {"x": 1}


def test_it_names_system_actors(release):
    assert do_record_event("system:worker", "x", release).actor_name == "system:worker"
    assert do_record_event(None, "x", release).actor_name == "system"


def test_it_refuses_updates(event):
    event.verb = "release.tampered"

    with pytest.raises(AppendOnlyError):
        event.save()
    with pytest.raises(AppendOnlyError):
        AuditEvent.objects.filter(pk=event.pk).update(verb="release.tampered")

    assert AuditEvent.objects.get(pk=event.pk).verb == "release.poked"


def test_it_refuses_deletes(event):
    with pytest.raises(AppendOnlyError):
        event.delete()
    with pytest.raises(AppendOnlyError):
        AuditEvent.objects.filter(pk=event.pk).delete()

    assert AuditEvent.objects.filter(pk=event.pk).exists()


def test_it_is_read_only_in_the_admin(event, admin_client):
    page = admin_client.get(f"/admin/audit/auditevent/{event.pk}/change/")
    assert page.status_code == 200
    assert b'name="_save"' not in page.content

    response = admin_client.post(f"/admin/audit/auditevent/{event.pk}/delete/")
    assert response.status_code == 403
    assert AuditEvent.objects.filter(pk=event.pk).exists()


def test_it_names_the_agent_whose_message_set_off_a_worker_event(release, owner):
    with on_behalf_of_agent("gpu-1"):
        worker = do_record_event("system:worker", "x", release)
        unnamed = do_record_event(None, "x", release)
        policy = do_record_event("system:auto-rollback", "x", release)
        person = do_record_event(owner, "x", release)
    after = do_record_event("system:worker", "x", release)

    assert worker.actor_name == unnamed.actor_name == "agent:gpu-1"
    assert policy.actor_name == "system:auto-rollback"
    assert person.actor_name == owner.username
    assert after.actor_name == "system:worker"


def test_it_names_a_token_by_its_prefix(release, owner, team):
    token, plaintext = ApiToken.create(owner, team, "ci", ["promote"])

    event = do_record_event(token, "x", release)

    assert event.actor_name == f"token:{plaintext[:TOKEN_PREFIX_LENGTH]} (ci, alice)"
    assert (event.actor_token, event.actor_user) == (token, owner)
