import pytest
from playwright.sync_api import expect

from controlplane.releases.actions.approvals import do_reject_release
from controlplane.releases.models import Release

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

REASON = "re-ran calibration with the Korean prompts"


def test_it_reopens_a_rejected_release_after_confirming(
    page, log_in, owner, teammate, member, awaiting_approval, outbox
):
    release = awaiting_approval()
    do_reject_release(release, teammate, comment="korean slice regressed")
    log_in("carol")  # a member: like the API, any member of the team may reopen
    page.goto(f"/releases/{release.pk}/")
    expect(page.locator("#register-hint")).to_contain_text("POST /api/v1/releases")

    page.get_by_label("Reason for reopening").fill(REASON)
    page.get_by_role("button", name="Reopen…").click()
    expect(page.get_by_role("heading", level=1)).to_have_text(f"Reopen {release}?")
    assert Release.objects.get(pk=release.pk).state == "rejected"
    page.get_by_role("button", name="Confirm reopen").click()

    expect(page.locator(".messages")).to_contain_text(f"Reopened {release}")
    expect(page.locator("h1 .state")).to_have_text("registered")
    expect(page.locator("#promote-hint")).to_contain_text(
        f"POST /api/v1/releases/{release.pk}/promote"
    )
    expect(page.get_by_role("button", name="Reopen…")).to_have_count(0)
    assert Release.objects.get(pk=release.pk).state == "registered"
    assert outbox() == []  # reopening promotes nothing by itself, as in the API
