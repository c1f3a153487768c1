import pytest
from playwright.sync_api import expect

from controlplane.fleet.models import Deployment
from controlplane.releases.actions import do_approve_release, do_fail_deployment
from controlplane.releases.models import Release
from tests.controlplane.browser.conftest import table_under

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ROLL_BACK = "Roll back to previous verified release"


@pytest.fixture
def broken(awaiting_approval, teammate, outbox, run_queued):
    """1.0.1 went live, 1.0.2 replaced it, then 1.0.2 failed re-verification."""
    old = awaiting_approval("1.0.1")
    do_approve_release(old, teammate, manifest_digest=old.manifest_digest)
    new = awaiting_approval("1.0.2")
    do_approve_release(new, teammate, manifest_digest=new.manifest_digest)
    assert run_queued() == ["live", "live"]
    deployment = Deployment.objects.get(release=new, state="live")
    do_fail_deployment(
        deployment,
        actor="system:worker",
        reason="manifest digest mismatch; changed: model.safetensors",
        verification=True,
    )
    return old, new


def _environment_row(page, environment):
    return (
        table_under(page, "Environments")
        .get_by_role("row")
        .filter(has_text=str(environment))
    )


def test_it_rolls_back_to_the_previous_verified_release(
    page, log_in, teammate, environment, broken, outbox, run_queued
):
    old, new = broken
    log_in("bob")
    row = _environment_row(page, environment)
    expect(row).to_contain_text(f"{new} failed_verification")

    row.get_by_role("button", name=ROLL_BACK).click()

    expect(page.locator(".messages")).to_contain_text(
        f"Rolling {environment} back to {old}."
    )
    expect(page.get_by_role("heading", level=1)).to_contain_text(str(old))
    expect(page.locator("h1 .state")).to_have_text("deploying")
    assert Release.objects.get(pk=new.pk).state == "quarantined"
    assert Release.objects.get(pk=old.pk).state == "deploying"
    assert Deployment.objects.get(release=new).state == "rolled_back"
    assert outbox() == [("run_deployment", (old.pk,))]

    assert run_queued() == ["live"]
    page.goto("/")
    row = _environment_row(page, environment)
    expect(row).to_contain_text(f"{old} live")
    expect(row.get_by_role("button", name=ROLL_BACK)).to_have_count(0)


def test_it_shows_a_member_no_rollback_button(
    page, log_in, member, environment, broken, outbox
):
    old, new = broken
    log_in("carol")

    row = _environment_row(page, environment)

    expect(row).to_contain_text(f"{new} failed_verification")
    expect(page.get_by_role("button", name=ROLL_BACK)).to_have_count(0)
    assert Release.objects.get(pk=new.pk).state == "failed_verification"
