"""Every dashboard page at a phone's width (390 px) with realistic long data: a
100-character model name, 50-character environment names, long versions, agent
names and usernames, 64-hex digests, long source paths and a failure reason that
is one unbroken path. No page may be wider than the viewport, and no element may
reach past its right edge unless a scroll box of its own clips it (a wide table
scrolls inside `.scroll`, never the page).

The pages are those of controlplane/dashboard/urls.py: the test fails when a
pattern there is not visited here (fragments are visited inside the page that
loads them)."""

import hashlib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.contrib.auth.models import User
from django.urls import get_resolver, resolve

from controlplane.accounts.actions import do_create_api_token
from controlplane.accounts.models import Membership
from controlplane.dashboard import urls as dashboard_urls
from controlplane.fleet.actions import do_record_agent_heartbeat, do_register_agent
from controlplane.fleet.models import Deployment, EnrollmentRequest
from controlplane.releases.actions.approvals import do_reject_release
from controlplane.releases.actions.deployments import do_fail_deployment
from controlplane.releases.actions.jobs import do_finish_job, do_start_job
from controlplane.releases.actions.rollbacks import do_rollback_environment
from tests.controlplane.browser.conftest import CHARTS_TIMEOUT_MS, WORKER
from tests.controlplane.conftest import PASSWORD
from tests.controlplane.dashboard.builders import take_live, to_awaiting_approval

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PHONE_WIDTH = 390
# 100 characters (the longest name a model family may have), no break opportunity.
LONG_MODEL = (
    "llama-3.1-70b-instruct-customer-support-tickets-multilingual-"
    "distilled-sft-dpo-merged-q4-awq-v2"
)
LONG_PRODUCTION = "production-eu-west-1-inference-cluster-blue-green"  # 50
LONG_STAGING = "staging-us-east-2-inference-cluster-canary-shadow1"  # 50
LONG_AGENT = "gpu-node-h100-sxm5-80gb-rack-17-slot-4-eu-west-1a-inference-pool-a"
LONG_GPU = "NVIDIA H100 80GB HBM3 (SXM5, MIG disabled, driver 550.54.15, CUDA 12.4)"
# 100 characters, the longest name a token may have.
LONG_TOKEN = (
    "ci-github-actions-release-pipeline-for-llama-customer-support-models-"
    "eu-west-1-production-deploys"
)
AGENT_ARTIFACTS = "/var/lib/releasegate/agent/artifacts/acme"
LONG_USER = "bartholomew.featherstonehaugh_worthington@mlplatform.example.com"
# Hosts the fragments load into (urls.py names -> the page that includes them).
FRAGMENTS = {
    "running-pipelines": "release-list",
    "release-status": "release-detail",
    "environment-rows": "environment-list",
}
KIMI_CONFIG = (
    Path(__file__).resolve().parents[2] / "data" / "configs" / "kimi-k2-instruct.json"
)
# a CSV download, an icon, and the fleet page's enrollment posts (they answer
# with the fleet page, seen here with a key waiting)
NOT_PAGES = {
    "cost-csv",
    "favicon",
    "enroll-agent",
    "reject-enrollment",
    "revoke-agent",
}

OVERFLOW_JS = "() => [document.documentElement.scrollWidth, window.innerWidth]"
# Elements, and runs of text, whose right edge is past the viewport and that no
# ancestor clips (a scroll box, or plotly's own overflow: hidden).
PAST_EDGE_JS = """() => {
  const width = document.documentElement.clientWidth;
  const clipped = (el) => {
    for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      if (getComputedStyle(p).overflowX !== "visible") return true;
    }
    return false;
  };
  const name = (el) => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") +
    (typeof el.className === "string" && el.className.trim()
      ? "." + el.className.trim().split(/\\s+/).join(".") : "");
  const found = [];
  for (const el of document.body.querySelectorAll("*")) {
    const box = el.getBoundingClientRect();
    if (box.width > 0 && box.right > width + 0.5 && !clipped(el)) {
      found.push(`${name(el)} right=${Math.round(box.right)}`);
    }
  }
  const texts = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const range = document.createRange();
  while (texts.nextNode()) {
    const text = texts.currentNode;
    if (!text.data.trim() || !text.parentElement) continue;
    range.selectNodeContents(text);
    const box = range.getBoundingClientRect();
    if (box.width > 0 && box.right > width + 0.5 && !clipped(text)) {
      found.push(`text in ${name(text.parentElement)} right=${Math.round(box.right)}`);
    }
  }
  return found.slice(0, 8);
}"""
CHARTS_DRAWN_JS = """() => [...document.querySelectorAll("[data-chart]")]
    .every((div) => div.querySelector(".main-svg"))"""


def hex64(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def version(n: int) -> str:
    return f"2024.11.{n}-rc.3+build.{hex64(str(n))[:40]}"


@pytest.fixture
def long_scene(
    owner,
    teammate,
    make_environment,
    make_model_family,
    make_release,
    queued,
):
    """Releases of a long-named model in every state a person looks at: live,
    failed_verification (a reason that is one long path with two digests),
    quarantined (after a rollback), awaiting approval, rejected, failed, and one
    whose pipeline is running with a failed job. The viewer is an approver with a
    long username."""
    viewer = User.objects.create_user(LONG_USER, password=PASSWORD)
    viewer.is_staff = True  # sees the agent keys waiting for enrollment
    viewer.save(update_fields=["is_staff"])
    EnrollmentRequest.objects.create(
        fingerprint=hex64("waiting"),
        public_key=hex64("waiting-key"),
        requested_name=LONG_AGENT + "-new",
        requested_pool="agents-" + LONG_AGENT,
        signing_public_key="-----BEGIN PUBLIC KEY-----",
        gpu_model=LONG_GPU,
    )
    Membership.objects.create(
        team=owner.memberships.get().team, user=viewer, role="approver"
    )
    agent = do_register_agent(
        LONG_AGENT,
        queue=f"agent.{LONG_AGENT}",
        gpu_model=LONG_GPU,
        gpu_memory_bytes=80 * 2**30,
        capabilities={"kv_cache_dtypes": ["bf16", "fp8", "int8"], "engine": "own"},
    )
    family = make_model_family(LONG_MODEL)
    production = make_environment(LONG_PRODUCTION)
    staging = make_environment(LONG_STAGING)
    versions = iter(range(1, 100))

    def release(environment, **fields):
        return make_release(
            version(next(versions)),
            family=family,
            target_environment=environment,
            **fields,
        )

    def awaiting(environment):
        return to_awaiting_approval(release(environment), agent=agent)

    def reason(bad):
        # The agent's copy, outside the source folder: shown as it is.
        copy = f"{AGENT_ARTIFACTS}/{family.name}/{bad.version}/checkpoint"
        return (
            f"manifest digest mismatch on {LONG_AGENT}: "
            f"{copy}/model-00002-of-00002.safetensors is "
            f"sha256:{hex64('found')}, the manifest says sha256:{hex64('signed')}"
        )

    def fail_verification(environment):
        take_live(awaiting(environment), teammate, agent=agent)
        bad = take_live(awaiting(environment), teammate, agent=agent)
        do_fail_deployment(
            Deployment.objects.get(release=bad, state="live"),
            actor=WORKER,
            reason=reason(bad),
            verification=True,
        )
        bad.refresh_from_db()
        return bad

    failed_verification = fail_verification(production)
    for _ in range(2):  # its live copy's re-verifications, the last one failed
        do_finish_job(do_start_job(failed_verification, "reverify", agent=agent))
    do_finish_job(
        do_start_job(failed_verification, "reverify", agent=agent),
        error=reason(failed_verification),
    )
    quarantined = fail_verification(staging)
    do_rollback_environment(staging, teammate, reason="bytes changed on disk")
    quarantined.refresh_from_db()
    assert (failed_verification.state, quarantined.state) == (
        "failed_verification",
        "quarantined",
    )
    rejected = awaiting(production)
    do_reject_release(rejected, teammate, comment=f"not this one: {reason(rejected)}")
    failed = release(production, state="failed")
    failed.failure_reason = reason(failed)
    failed.save(update_fields=["failure_reason"])
    running = release(production, state="evaluating")
    do_finish_job(do_start_job(running, "verify_source", agent=agent))
    do_finish_job(do_start_job(running, "compress", agent=agent), error=reason(running))
    do_start_job(running, "evaluate", agent=agent)
    candidate = awaiting(production)
    do_create_api_token(viewer, production.team, LONG_TOKEN, ["read", "approve"])
    do_record_agent_heartbeat(agent)
    return {
        "family": family,
        "production": production,
        "candidate": candidate,
        "failed_verification": failed_verification,
        "quarantined": quarantined,
        "rejected": rejected,
        "failed": failed,
        "running": running,
    }


def dashboard_page_names() -> set[str]:
    patterns = get_resolver(dashboard_urls).url_patterns
    return {p.name for p in patterns} - NOT_PAGES - set(FRAGMENTS)


def test_it_fits_every_page_in_a_phone_viewport(
    browser, live_server, long_scene, screenshot
):
    context = browser.new_context(
        base_url=live_server.url, viewport={"width": PHONE_WIDTH, "height": 800}
    )
    context.set_default_timeout(10_000)
    page = context.new_page()
    visited, too_wide = set(), []

    def check(label: str, url: str | None = None) -> None:
        if url is not None:
            response = page.goto(url)
            assert response.status == 200, (url, response.status)
        page.wait_for_function(CHARTS_DRAWN_JS, timeout=CHARTS_TIMEOUT_MS)
        visited.add(resolve(urlsplit(page.url).path).url_name)
        screenshot(page, "long-" + label.replace(" ", "-"))
        scroll_width, inner_width = page.evaluate(OVERFLOW_JS)
        past_edge = page.evaluate(PAST_EDGE_JS)
        if scroll_width > inner_width or past_edge:
            too_wide.append(f"{label}: {scroll_width} px; {past_edge}")

    page.goto("/accounts/login/")
    check("login")
    page.get_by_label("Username").fill(LONG_USER)
    page.get_by_label("Password").fill(PASSWORD)
    with page.expect_navigation():
        page.get_by_role("button", name="Log in").click()
    check("releases")
    check("releases filtered", f"/?model={long_scene['family'].pk}")
    for state in ("failed_verification", "quarantined", "failed", "running"):
        check(state, f"/releases/{long_scene[state].pk}/")
    check(
        "reverifications",
        f"/releases/{long_scene['failed_verification'].pk}/reverifications/",
    )
    check("awaiting_approval", f"/releases/{long_scene['candidate'].pk}/")
    page.get_by_role("button", name="Approve…").click()
    check("confirm approve")
    page.goto(f"/releases/{long_scene['candidate'].pk}/")
    page.get_by_label("Reason for rejecting").fill(f"see {LONG_MODEL}")
    page.get_by_role("button", name="Reject…").click()
    check("confirm reject")
    page.goto(f"/releases/{long_scene['candidate'].pk}/")
    page.get_by_role("button", name="Re-measure…").click()
    check("confirm remeasure")
    check("rejected", f"/releases/{long_scene['rejected'].pk}/")
    page.get_by_label("Reason for reopening").fill(f"rebuilt {LONG_MODEL}")
    page.get_by_role("button", name="Reopen…").click()
    check("confirm reopen")
    check("environments", "/environments/")
    page.get_by_role("button", name="Roll back to").first.click()
    check("confirm rollback")
    check("load plan", f"/environments/{long_scene['production'].pk}/load-plan/")
    check("fleet", "/fleet/")
    check("cost", "/cost/")
    check("cost filtered", f"/cost/?model={long_scene['family'].pk}")
    check("audit", "/audit/")
    check("sizing", "/sizing/")
    page.get_by_label("config.json").fill(KIMI_CONFIG.read_text())
    page.get_by_role("button", name="Size it").click()
    check("sizing report")
    check("tokens", "/tokens/")
    check("new token", "/tokens/new/")
    page.get_by_label("Name").fill(LONG_TOKEN + "-2")
    page.get_by_role("button", name="Create token").click()
    check("token created")
    page.goto("/tokens/")
    page.get_by_role("button", name="Revoke…").first.click()
    check("confirm revoke token")
    context.close()

    assert not too_wide, "\n".join(too_wide)
    assert visited >= dashboard_page_names(), dashboard_page_names() - visited
