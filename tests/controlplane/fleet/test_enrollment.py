"""Enrollment actions (controlplane.fleet.enrollment) beyond the API's: the dev
path that enrolls this machine's own agent, and who may enroll."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.errors import Conflict, Forbidden, ValidationFailed
from controlplane.fleet.enrollment import (
    check_operator,
    do_enroll_agent,
    do_enroll_local_agent,
    do_revoke_agent,
)
from controlplane.fleet.models import Agent, EnrollmentRequest
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


def pending_request(key) -> EnrollmentRequest:
    return EnrollmentRequest.objects.create(
        fingerprint=identity.fingerprint(key),
        public_key=key.hex(),
        requested_name="gpu-1",
    )


def test_it_enrolls_allowed_programs_as_presets_and_whole_templates(db, key):
    programs = ["vllm", "{python} -m gpuagent.engine serve {model_dir}", "vllm"]

    agent = do_enroll_agent(
        pending_request(key), actor="system:tests", allowed_programs=programs
    )

    assert agent.allowed_programs == programs[:2]  # each entry once


@pytest.mark.parametrize(
    "programs, problem",
    [
        ("vllm", "must be a list"),
        (["{python} {nope}"], "unknown placeholder(s) in command template: {nope}"),
        ([""], "empty command template"),
    ],
)
def test_it_refuses_allowed_programs_the_agent_could_not_run(
    db, key, programs, problem
):
    with pytest.raises(ValidationFailed) as refused:
        do_enroll_agent(
            pending_request(key), actor="system:tests", allowed_programs=programs
        )

    assert refused.value.field == "allowed_programs"
    assert problem in refused.value.message
    assert not Agent.objects.exists()
