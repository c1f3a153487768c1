import pytest
from playwright.sync_api import expect

from controlplane.releases.models import Approval, Release

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

COMMENT = "korean slice regressed: 6 flips"


def test_it_rejects_with_the_comment_after_confirming(
    page, log_in, owner, teammate, awaiting_approval, outbox
):
    release = awaiting_approval()
    log_in("bob")
    page.goto(f"/releases/{release.pk}/")

    page.get_by_label("Reason for rejecting").fill(COMMENT)
    page.get_by_role("button", name="Reject…").click()
    expect(page.get_by_role("heading", level=1)).to_have_text(f"Reject {release}?")
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
    page.get_by_role("button", name="Confirm rejection").click()

    expect(page.locator(".messages")).to_contain_text(f"Rejected {release}")
    expect(page.locator("h1 .state")).to_have_text("rejected")
    expect(page.get_by_text(f"Reason: {COMMENT}")).to_be_visible()
    expect(page.get_by_role("button", name="Reject…")).to_have_count(0)
    expect(page.locator("#approvals")).to_contain_text(COMMENT)
    stored = Release.objects.get(pk=release.pk)
    assert (stored.state, stored.failure_reason) == ("rejected", COMMENT)
    approval = Approval.objects.get(release=release)
    assert (approval.user, approval.decision, approval.comment) == (
        teammate,
        "reject",
        COMMENT,
    )
    assert approval.manifest_digest == release.manifest_digest
    assert outbox() == []


def test_it_asks_for_a_reason_before_rejecting(
    page, log_in, owner, teammate, awaiting_approval, outbox
):
    release = awaiting_approval()
    log_in("bob")
    page.goto(f"/releases/{release.pk}/")

    page.get_by_role("button", name="Reject…").click()  # the browser refuses it

    expect(page.get_by_label("Reason for rejecting")).to_have_js_property(
        "validity.valueMissing", True
    )
    expect(page.get_by_role("heading", level=1)).to_contain_text(str(release))
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
