import pytest

from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict, Forbidden, ValidationFailed
from controlplane.releases.actions.registration import do_create_model_family
from controlplane.releases.models import ModelFamily


def test_it_creates_a_model_family(team, member):
    family = do_create_model_family(team, "qwen-coder", actor=member, description="x")

    assert family.team == team
    assert AuditEvent.objects.get(verb="model.created").object_id == str(family.pk)


def test_it_refuses_a_duplicate_name_in_the_same_team(team, owner, model_family):
    with pytest.raises(Conflict) as info:
        do_create_model_family(team, model_family.name, actor=owner)

    assert info.value.field == "name"


def test_it_allows_the_same_name_in_another_team(other_team, outsider, model_family):
    family = do_create_model_family(other_team, model_family.name, actor=outsider)

    assert family.team == other_team


def test_it_refuses_outsiders(team, outsider):
    with pytest.raises(Forbidden):
        do_create_model_family(team, "sneaky", actor=outsider)

    assert not ModelFamily.objects.filter(name="sneaky").exists()


def test_it_refuses_an_empty_name(team, owner):
    with pytest.raises(ValidationFailed):
        do_create_model_family(team, "  ", actor=owner)
