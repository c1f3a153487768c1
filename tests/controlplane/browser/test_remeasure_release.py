import pytest
from playwright.sync_api import expect

from controlplane.releases.models import Release

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_it_remeasures_the_load_test_after_confirming(
    page, log_in, owner, member, awaiting_approval, outbox
):
    release = awaiting_approval()
    log_in("carol")  # a member: like the API, whoever may promote in the team
    page.goto(f"/releases/{release.pk}/")
    expect(page.get_by_role("heading", name="Re-measure")).to_be_visible()

    page.locator("#remeasure-evaluate").uncheck()
    expect(page.locator("#remeasure-load_test")).to_be_checked()
    page.get_by_role("button", name="Re-measure…").click()
    expect(page.get_by_role("heading", level=1)).to_have_text(f"Re-measure {release}?")
    expect(page.locator("#remeasure-stages li")).to_have_count(1)
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
    page.get_by_role("button", name="Confirm re-measure").click()

    expect(page.locator(".messages")).to_contain_text(f"Re-measuring {release}")
    expect(page.locator("h1 .state")).to_have_text("gated")
    expect(page.locator("#remeasure-refusal")).to_contain_text("being measured")
    expect(page.get_by_role("button", name="Re-measure…")).to_have_count(0)
    assert Release.objects.get(pk=release.pk).state == "gated"
    [(task, (request, _sealed))] = outbox()
    assert (task, request["kind"]) == ("run_job", "load_test")
