import pytest
from playwright.sync_api import expect

from controlplane.fleet.models import Deployment
from controlplane.releases.actions.manifests import do_record_manifest
from controlplane.releases.models import Approval, Release
from gpuagent.protocol import FileDigest
from tests.controlplane.browser.conftest import CHARTS_TIMEOUT_MS, LIVE_TIMEOUT_MS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

APPROVE = "Approve…"
CHARTS = ("memory", "load-0", "ttft", "tpot", "kv_sessions", "quality_kld")


def test_it_approves_the_full_digest_after_confirming_and_shows_it_go_live(
    page, log_in, owner, teammate, awaiting_approval, outbox, run_queued
):
    release = awaiting_approval()
    log_in("bob")
    page.goto(f"/releases/{release.pk}/")
    for name in CHARTS:
        chart = page.locator(f"#chart-{name}")
        expect(chart.locator(".main-svg").first).to_be_attached(
            timeout=CHARTS_TIMEOUT_MS
        )
        assert chart.evaluate("(div) => div.data.length") > 0, name
    expect(page.locator("#decision-digest")).to_have_text(release.manifest_digest)

    page.get_by_label("Comment").fill("numbers hold at 32 sessions")
    page.get_by_role("button", name=APPROVE).click()

    expect(page.get_by_role("heading", level=1)).to_have_text(f"Approve {release}?")
    expect(page.locator("#confirm-digest")).to_have_text(release.manifest_digest)
    assert not Approval.objects.filter(release=release).exists()
    page.get_by_role("button", name="Confirm approval").click()

    expect(page.locator(".messages")).to_contain_text(f"Approved {release}")
    expect(page.locator("h1 .state")).to_have_text("approved")
    expect(page.get_by_role("button", name=APPROVE)).to_have_count(0)
    expect(page.locator("#approvals")).to_contain_text(release.manifest_digest)
    approval = Approval.objects.get(release=release)
    assert (approval.user, approval.decision) == (teammate, "approve")
    assert approval.comment == "numbers hold at 32 sessions"
    assert approval.manifest_digest == release.manifest_digest
    assert Release.objects.get(pk=release.pk).state == "approved"
    assert outbox() == [("run_deployment", (release.pk,))]

    assert run_queued() == ["deploying", "live"]  # task, then the agent's answer

    # No reload: the page follows the release by itself.
    expect(page.locator("h1 .state")).to_have_text("live", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#stages")).to_contain_text("deploy")
    assert Deployment.objects.get(release=release).state == "live"


def test_it_refuses_an_approval_of_a_digest_that_changed_meanwhile(
    page, log_in, owner, teammate, awaiting_approval, outbox
):
    release = awaiting_approval()
    log_in("bob")
    page.goto(f"/releases/{release.pk}/")
    # The candidate is rebuilt while bob reads the page: his form carries the old
    # digest, and an approval is bound to the bytes the approver saw.
    new_digest = "sha256:" + "e" * 64
    do_record_manifest(
        release,
        manifest_digest=new_digest,
        files=[FileDigest(path="model.safetensors", size_bytes=1, digest=new_digest)],
    )

    page.get_by_role("button", name=APPROVE).click()

    expect(page.locator(".messages .error")).to_contain_text("approval is for manifest")
    expect(page.locator("h1 .state")).to_have_text("awaiting_approval")
    expect(page.locator("#decision-digest")).to_have_text(new_digest)
    assert not Approval.objects.filter(release=release).exists()
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
    assert outbox() == []


def test_it_tells_the_registrant_why_it_cannot_approve(
    page, log_in, owner, teammate, awaiting_approval, outbox
):
    release = awaiting_approval()
    log_in("alice")

    page.goto(f"/releases/{release.pk}/")

    expect(page.locator("h1 .state")).to_have_text("awaiting_approval")
    expect(page.locator("#manifest-digest")).to_have_text(release.manifest_digest)
    expect(page.locator("#decision-refusal")).to_contain_text(
        f"alice registered {release} and cannot also approve it"
    )
    expect(page.get_by_role("button", name=APPROVE)).to_have_count(0)
    expect(page.get_by_role("button", name="Reject…")).to_have_count(0)


def test_it_refuses_a_forced_approval_by_the_registering_owner(
    page, log_in, owner, teammate, awaiting_approval, outbox
):
    release = awaiting_approval()
    log_in("alice")
    page.goto(f"/releases/{release.pk}/")

    # Build the form the page withholds, with the session's own CSRF token (from the
    # logout form), and submit it from the browser.
    with page.expect_navigation() as navigation:
        page.evaluate(
            """([action, digest]) => {
                const form = document.createElement("form");
                form.method = "post";
                form.action = action;
                const fields = {
                    csrfmiddlewaretoken: document.querySelector(
                        "input[name=csrfmiddlewaretoken]").value,
                    manifest_digest: digest,
                    comment: "approving my own release",
                    confirmed: "yes",
                };
                for (const [name, value] of Object.entries(fields)) {
                    const input = document.createElement("input");
                    input.type = "hidden";
                    input.name = name;
                    input.value = value;
                    form.appendChild(input);
                }
                document.body.appendChild(form);
                form.submit();
            }""",
            [f"/releases/{release.pk}/approve/", release.manifest_digest],
        )

    assert navigation.value.status == 403
    expect(page.locator("body")).to_contain_text("cannot also approve")
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
    assert not Approval.objects.filter(release=release).exists()
    assert outbox() == []
