import pytest

from controlplane.audit.actions import do_record_event
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
