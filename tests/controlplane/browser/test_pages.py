"""Every dashboard page in a real browser at desktop (1280 px) and phone (390 px)
width: a screenshot of each (var/test-artifacts/screenshots), charts drawn by the
local plotly.js, and no page wider than a phone's viewport."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.fleet.actions import do_record_agent_heartbeat, do_register_agent
from controlplane.fleet.models import Agent, Deployment
from controlplane.releases.actions.approvals import do_reject_release
from controlplane.releases.actions.deployments import do_fail_deployment
from controlplane.releases.actions.jobs import do_finish_job, do_start_job
from controlplane.releases.actions.registration import do_register_release
from controlplane.releases.models import Job
from tests.controlplane.browser.conftest import CHARTS_TIMEOUT_MS
from tests.controlplane.conftest import PASSWORD, RECIPE
from tests.controlplane.dashboard.builders import take_live, to_awaiting_approval

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTHS = (1280, 390)
BF16_RECIPE = {"weights": "bf16", "kv_cache_dtype": "bf16"}
FP8_RECIPE = {"weights": "int8", "kv_cache_dtype": "fp8"}
OVERFLOW_JS = "() => [document.documentElement.scrollWidth, window.innerWidth]"
# Every chart on the page has its plot drawn (true on a page without charts).
CHARTS_DRAWN_JS = """() => [...document.querySelectorAll("[data-chart]")]
    .every((div) => div.querySelector(".main-svg"))"""
CHART_TRACES_JS = "(div) => (div.data || []).length"


@pytest.fixture
def scene(
    owner,
    teammate,
    make_environment,
    make_release,
    make_source,
    awaiting_approval,
    expire_lease,
    queued,
):
    """What a release manager meets on a busy day: staging runs 0.9.5 (0.9.0 before
    it), candidate 1.0.0 waits for approval (its reference build was rejected);
    production's 0.8.1 failed verification (0.8.0 is the rollback target); 1.1.0's
    pipeline skipped compressing and has a stuck and a retried job on a dead
    agent."""
    alive = do_register_agent(
        "gpu-a1",
        queue="agent.gpu-a1",
        gpu_model="NVIDIA H100 80GB HBM3",
        gpu_memory_bytes=80 * 2**30,
        capabilities={"kv_cache_dtypes": ["bf16", "fp8", "int8"], "engine": "own"},
    )
    dead = do_register_agent(
        "gpu-b2",
        queue="agent.gpu-b2",
        gpu_model="NVIDIA L40S",
        gpu_memory_bytes=48 * 2**30,
    )
    Agent.objects.filter(pk=dead.pk).update(
        last_heartbeat=timezone.now() - timedelta(minutes=7)
    )
    production = make_environment("production")
    for version in ("0.8.0", "0.8.1"):
        release = awaiting_approval(
            version, target_environment=production, agent=alive, speed=0.7
        )
        take_live(release, teammate, agent=alive)
    do_fail_deployment(
        Deployment.objects.get(release__version="0.8.1"),
        actor="system:worker",
        reason="manifest digest mismatch; changed: model-00002-of-00002.safetensors",
        verification=True,
    )
    for version in ("0.9.0", "0.9.5"):
        release = awaiting_approval(
            version, recipe=FP8_RECIPE, agent=alive, speed=0.8, kld=0.008
        )
        take_live(release, teammate, agent=alive)
    reference = awaiting_approval("1.0.0-bf16", recipe=BF16_RECIPE, agent=alive)
    do_reject_release(reference, teammate, comment="reference build, not served")
    candidate, _ = do_register_release(
        reference.model,
        version="1.0.0",
        source_uri=make_source(f"{reference.model.name}/1.0.0").as_uri(),
        recipe=RECIPE,
        target_environment=reference.target_environment,
        actor=owner,
        parent=reference,
    )
    to_awaiting_approval(candidate, agent=alive, speed=1.3, kld=0.006)
    running = make_release("1.1.0", state="evaluating")
    do_finish_job(
        do_start_job(running, "compress", agent=alive),
        result={"skipped": "the recipe keeps bf16 weights: nothing to compress"},
    )
    stuck = do_start_job(running, "evaluate", agent=dead)
    retried = do_start_job(running, "load_test", agent=alive)
    expire_lease(retried)
    do_start_job(running, "load_test", agent=alive)
    expire_lease(stuck)
    return {
        "candidate": candidate,
        "rejected": reference,
        "running": running,
        "alive": alive,
    }


def _check_fits(page, name: str) -> None:
    scroll_width, inner_width = page.evaluate(OVERFLOW_JS)
    assert scroll_width <= inner_width, f"{name}: {scroll_width} px > {inner_width} px"


def test_it_shows_every_page_at_desktop_and_phone_width(
    browser, live_server, scene, screenshot
):
    candidate, running = scene["candidate"], scene["running"]
    for width in WIDTHS:
        # Setting the scene took longer than an agent may stay silent.
        do_record_agent_heartbeat(scene["alive"])
        context = browser.new_context(
            base_url=live_server.url, viewport={"width": width, "height": 900}
        )
        context.set_default_timeout(10_000)
        page = context.new_page()

        def visit(name: str, url: str | None = None, page=page) -> None:
            if url is not None:
                page.goto(url)
            page.wait_for_function(CHARTS_DRAWN_JS, timeout=CHARTS_TIMEOUT_MS)
            screenshot(page, name)
            if page.viewport_size["width"] <= 390:
                _check_fits(page, name)

        visit("login", "/accounts/login/")
        page.get_by_label("Username").fill("bob")
        page.get_by_label("Password").fill(PASSWORD)
        with page.expect_navigation():
            page.get_by_role("button", name="Log in").click()
        visit("releases")
        visit("release-detail", f"/releases/{candidate.pk}/")
        charts = page.locator("[data-chart]")
        assert charts.count() >= 9
        for index in range(charts.count()):
            assert charts.nth(index).evaluate(CHART_TRACES_JS) > 0
        page.get_by_role("button", name="Approve…").click()
        visit("confirm-approve")
        visit("release-rejected", f"/releases/{scene['rejected'].pk}/")
        page.get_by_label("Reason for reopening").fill("rebuilt: tokenizer fixed")
        page.get_by_role("button", name="Reopen…").click()
        visit("confirm-reopen")
        visit("release-running", f"/releases/{running.pk}/")
        visit("environments", "/environments/")
        page.get_by_role("button", name="Roll back to").first.click()
        visit("confirm-rollback")
        visit("fleet", "/fleet/")
        visit("cost", "/cost/")
        visit("audit", "/audit/")
        context.close()
    assert Job.objects.filter(release=running, state="running").count() == 2
    scene["rejected"].refresh_from_db()
    assert scene["rejected"].state == "rejected"  # confirmations were not confirmed
