"""Enrollment actions (controlplane.fleet.enrollment) beyond the API's: the dev
path that enrolls this machine's own agent, and who may enroll."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict, Forbidden
from controlplane.fleet.enrollment import (
    check_operator,
    do_enroll_local_agent,
    do_revoke_agent,
)
from controlplane.fleet.models import Agent
from gpuagent.integrity import identity


@pytest.fixture
def key(tmp_path):
    return identity.public_raw(identity.load_or_create_key(tmp_path / "id.key"))


def test_the_dev_path_enrolls_the_local_agent_once_and_audits_it(db, key):
    first = do_enroll_local_agent("local", key, actor="system:demo")
    again = do_enroll_local_agent("local", key, actor="system:demo")

    assert first.pk == again.pk
    assert (first.enrollment, first.fingerprint) == (
        "enrolled",
        identity.fingerprint(key),
    )
    enrolled = AuditEvent.objects.get(verb="agent.enrolled")
    assert enrolled.actor_name == "system:demo"


def test_the_dev_path_never_brings_back_a_revoked_key(db, key):
    agent = do_enroll_local_agent("local", key, actor="system:demo")
    do_revoke_agent(agent, actor="system:tests")

    with pytest.raises(Conflict, match="revoked"):
        do_enroll_local_agent("local", key, actor="system:demo")

    assert Agent.objects.get().enrollment == "revoked"


def test_only_staff_are_operators(owner):
    with pytest.raises(Forbidden, match="staff"):
        check_operator(owner)
    owner.is_staff = True
    check_operator(owner)
