import pytest
from playwright.sync_api import expect

from controlplane.releases.models import Approval, Release
from tests.controlplane.browser.conftest import table_under

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

COMMENT = "perplexity regressed on the support set"


def test_it_rejects_with_the_comment(
    page, log_in, owner, teammate, awaiting_approval, outbox
):
    release = awaiting_approval()
    log_in("bob")
    page.goto(f"/releases/{release.pk}/")

    page.get_by_label("Reason for rejecting").fill(COMMENT)
    page.get_by_role("button", name="Reject").click()

    expect(page.locator(".messages")).to_contain_text(f"Rejected {release}")
    expect(page.locator("h1 .state")).to_have_text("rejected")
    expect(page.get_by_text(f"Reason: {COMMENT}")).to_be_visible()
    expect(page.get_by_role("button", name="Reject")).to_have_count(0)
    decision = table_under(page, "Approvals").get_by_role("row").nth(1)
    expect(decision).to_contain_text(f"bob reject {release.manifest_digest} {COMMENT}")
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


def test_it_needs_a_reason(page, log_in, owner, teammate, awaiting_approval, outbox):
    release = awaiting_approval()
    log_in("bob")
    page.goto(f"/releases/{release.pk}/")

    page.get_by_role("button", name="Reject").click()  # the browser refuses it

    expect(page.get_by_label("Reason for rejecting")).to_have_js_property(
        "validity.valueMissing", True
    )
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
