import pytest
from playwright.sync_api import expect

from controlplane.fleet.models import Deployment
from controlplane.releases.actions.approvals import do_approve_release
from controlplane.releases.actions.deployments import do_fail_deployment
from controlplane.releases.models import Release
from tests.controlplane.browser.conftest import LIVE_TIMEOUT_MS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

REASON = "manifest digest mismatch; changed: model-00002-of-00002.safetensors"


@pytest.fixture
def broken(awaiting_approval, teammate, outbox, run_queued):
    """1.0.1 went live, 1.0.2 replaced it, then 1.0.2 failed re-verification."""
    old = awaiting_approval("1.0.1")
    do_approve_release(old, teammate, manifest_digest=old.manifest_digest)
    new = awaiting_approval("1.0.2")
    do_approve_release(new, teammate, manifest_digest=new.manifest_digest)
    assert run_queued() == ["deploying", "deploying", "live", "live"]
    deployment = Deployment.objects.get(release=new, state="live")
    do_fail_deployment(
        deployment, actor="system:worker", reason=REASON, verification=True
    )
    return old, new


def _section(page, environment):
    return page.locator(f"#environment-{environment.pk}")


def test_it_rolls_back_to_the_previous_verified_release(
    page, log_in, teammate, environment, broken, outbox, run_queued
):
    old, new = broken
    log_in("bob")
    page.goto("/environments/")
    section = _section(page, environment)
    expect(section).to_contain_text(f"Failed verification: {REASON}")
    expect(section.locator("tr.live-release")).to_contain_text(
        f"{new} failed_verification"
    )
    # Its deploy job verified the bytes on load (after the verify job did).
    expect(section.locator("tr.rollback-target")).to_contain_text(
        f"{old}: verified by its deploy job"
    )

    section.get_by_role("button", name=f"Roll back to {old}…").click()
    expect(page.get_by_role("heading", level=1)).to_have_text(
        f"Roll {environment} back?"
    )
    expect(page.locator("main")).to_contain_text(old.manifest_digest)
    assert Release.objects.get(pk=new.pk).state == "failed_verification"
    page.get_by_role("button", name=f"Confirm rollback to {old}").click()

    expect(page.locator(".messages")).to_contain_text(
        f"Rolling {environment} back to {old}."
    )
    assert Release.objects.get(pk=new.pk).state == "quarantined"
    assert Release.objects.get(pk=old.pk).state == "deploying"
    assert Deployment.objects.get(release=new).state == "rolled_back"
    assert outbox() == [("run_deployment", (old.pk,))]

    assert run_queued() == ["deploying", "live"]

    # No reload: the environments page follows the deployment by itself.
    live_row = _section(page, environment).locator("tr.live-release")
    expect(live_row).to_contain_text(f"{old} live", timeout=LIVE_TIMEOUT_MS)
    expect(page.get_by_role("button", name="Roll back to")).to_have_count(0)


def test_it_shows_a_member_why_there_is_no_rollback_button(
    page, log_in, member, environment, broken, outbox
):
    old, new = broken
    log_in("carol")

    page.goto("/environments/")

    expect(_section(page, environment)).to_contain_text(f"{new} failed_verification")
    expect(page.get_by_role("button", name="Roll back to")).to_have_count(0)
    expect(_section(page, environment)).to_contain_text("needs role approver or admin")
    assert Release.objects.get(pk=new.pk).state == "failed_verification"
