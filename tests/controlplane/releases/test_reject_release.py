import pytest

from controlplane.audit.models import AuditEvent
from controlplane.errors import (
    DigestMismatch,
    Forbidden,
    IllegalTransition,
    SeparationOfDuties,
    ValidationFailed,
)
from controlplane.releases.actions.approvals import (
    check_decide_release,
    do_reject_release,
)
from controlplane.releases.models import Release


@pytest.mark.parametrize("state", ["awaiting_approval", "gated", "registered"])
def test_it_rejects(make_release, teammate, state):
    release = make_release(state=state)

    approval = do_reject_release(release, teammate, comment="perplexity regressed")

    stored = Release.objects.get(pk=release.pk)
    assert stored.state == "rejected"
    assert stored.failure_reason == "perplexity regressed"
    assert approval.decision == "reject"
    assert AuditEvent.objects.filter(verb="release.rejected").count() == 1


def test_it_refuses_members_without_approver_role(make_release, member):
    release = make_release(state="awaiting_approval")

    with pytest.raises(Forbidden):
        do_reject_release(release, member, comment="no")


def test_it_refuses_outsiders(make_release, outsider):
    release = make_release(state="awaiting_approval")

    with pytest.raises(Forbidden):
        do_reject_release(release, outsider, comment="no")


def test_it_cannot_reject_a_live_release(make_release, teammate):
    release = make_release(state="live")

    with pytest.raises(IllegalTransition):
        do_reject_release(release, teammate, comment="no")


@pytest.mark.parametrize("comment", ["", "   "])
def test_it_needs_a_reason(make_release, teammate, comment):
    release = make_release(state="awaiting_approval")

    with pytest.raises(ValidationFailed) as caught:
        do_reject_release(release, teammate, comment=comment)

    assert caught.value.field == "comment"
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"


def test_it_refuses_the_registrant(make_release, owner, teammate):
    release = make_release(state="awaiting_approval", actor=teammate)

    with pytest.raises(SeparationOfDuties, match="bob registered"):
        do_reject_release(release, teammate, comment="withdrawing my own release")

    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
    do_reject_release(release, owner, comment="a colleague may")
    assert Release.objects.get(pk=release.pk).state == "rejected"


def test_it_refuses_a_manifest_recorded_after_the_check(make_release, teammate):
    reviewed = "sha256:" + "a" * 64
    release = make_release(state="awaiting_approval", manifest_digest=reviewed)
    check_decide_release(release, teammate, decision="reject", manifest_digest=reviewed)
    Release.objects.filter(pk=release.pk).update(manifest_digest="sha256:" + "b" * 64)

    with pytest.raises(DigestMismatch):
        do_reject_release(
            release, teammate, comment="too slow", manifest_digest=reviewed
        )

    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
    assert not release.approvals.exists()
