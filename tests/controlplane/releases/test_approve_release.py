import pytest

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent
from controlplane.errors import (
    DigestMismatch,
    Forbidden,
    IllegalTransition,
    SeparationOfDuties,
)
from controlplane.releases.actions.approvals import (
    check_approve_release,
    do_approve_release,
)
from controlplane.releases.models import Approval, Release

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def waiting(make_release):
    return make_release(state="awaiting_approval", manifest_digest=DIGEST)


@pytest.fixture
def deploys(queued):
    return lambda: queued("run_deployment")


def test_it_approves_and_binds_the_manifest_digest(waiting, teammate, deploys):
    approval = do_approve_release(waiting, teammate, comment="lgtm")

    assert Release.objects.get(pk=waiting.pk).state == "approved"
    assert approval.manifest_digest == DIGEST
    assert approval.decision == "approve"
    assert deploys() == [(waiting.pk,)]
    assert AuditEvent.objects.get(verb="release.approved").after["comment"] == "lgtm"


def test_it_refuses_the_user_who_registered_it(waiting, owner):
    # owner is an admin (may approve in general) but registered this release.
    with pytest.raises(SeparationOfDuties):
        do_approve_release(waiting, owner)

    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"
    assert not Approval.objects.exists()


def test_it_refuses_the_token_that_registered_it(make_release, teammate, team):
    token, _ = ApiToken.create(teammate, team, "ci", ["register", "approve"])
    release = make_release(actor=token, state="awaiting_approval")

    with pytest.raises(SeparationOfDuties):
        check_approve_release(release, teammate, token)


def test_it_refuses_plain_members(waiting, member):
    with pytest.raises(Forbidden):
        do_approve_release(waiting, member)


def test_it_refuses_outsiders(waiting, outsider):
    with pytest.raises(Forbidden):
        do_approve_release(waiting, outsider)


def test_it_requires_the_approve_scope(waiting, teammate, team):
    token, _ = ApiToken.create(teammate, team, "ci", ["read", "promote"])

    with pytest.raises(Forbidden):
        do_approve_release(waiting, teammate, token=token)


def test_it_approves_through_a_token_and_records_it(waiting, teammate, team, deploys):
    token, _ = ApiToken.create(teammate, team, "release-bot", ["approve"])

    approval = do_approve_release(waiting, teammate, token=token)

    assert approval.token == token
    assert AuditEvent.objects.get(verb="release.approved").actor_token == token


def test_it_refuses_a_stale_manifest_digest(waiting, teammate):
    with pytest.raises(DigestMismatch):
        do_approve_release(waiting, teammate, manifest_digest="sha256:" + "00" * 32)

    assert Release.objects.get(pk=waiting.pk).state == "awaiting_approval"


def test_it_refuses_a_release_not_awaiting_approval(make_release, teammate):
    release = make_release(state="evaluating")

    with pytest.raises(IllegalTransition):
        do_approve_release(release, teammate)


def test_it_refuses_a_second_approval(waiting, teammate, deploys):
    do_approve_release(waiting, teammate)

    with pytest.raises(IllegalTransition):
        do_approve_release(waiting, teammate)

    assert Approval.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_binds_the_digest_it_approved_when_a_manifest_lands_concurrently(
    waiting, teammate, deploys, monkeypatch
):
    """A stale worker records a new manifest while the approval is in flight: the
    approval must hold the row, so the manifest write waits and is then refused."""
    import threading

    from django.db import connection, connections

    from controlplane.errors import Conflict
    from controlplane.releases.actions import approvals, manifests
    from gpuagent.protocol import FileDigest

    if connection.vendor != "postgresql":
        pytest.skip("needs row locks between two connections (PostgreSQL, as in CI)")
    other = "sha256:" + "ef" * 32
    outcome = {}

    def record_other_manifest():
        try:
            manifests.do_record_manifest(
                Release.objects.get(pk=waiting.pk),
                manifest_digest=other,
                files=[FileDigest(path="a", size_bytes=1, digest=other)],
            )
            outcome["recorded"] = True
        except Conflict:
            outcome["refused"] = True
        finally:
            connections.close_all()

    real_transition = approvals.do_transition_release
    writer = threading.Thread(target=record_other_manifest)

    def transition_after_a_concurrent_manifest(release, to_state, **kw):
        if to_state == "approved" and not writer.is_alive():
            writer.start()
            writer.join(timeout=1.0)  # blocks on the row lock once it is held
        return real_transition(release, to_state, **kw)

    monkeypatch.setattr(
        approvals, "do_transition_release", transition_after_a_concurrent_manifest
    )

    approval = do_approve_release(waiting, teammate, manifest_digest=DIGEST)
    writer.join(timeout=10)

    assert outcome == {"refused": True}
    assert approval.manifest_digest == DIGEST
    assert Release.objects.get(pk=waiting.pk).manifest_digest == DIGEST
