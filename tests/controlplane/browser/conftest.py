"""Real-browser tests of the dashboard: headless Chromium, driven by Playwright,
against pytest-django's `live_server` (a real HTTP server in a thread of this process).

The cast comes from tests/controlplane/conftest.py (alice the owner, bob the approver,
carol a member, mallory the outsider). Releases reach their states through the real
actions; the Celery tasks they queue stay in the outbox (`outbox()` lists them) and
run in the test with `run_queued()`.
"""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone

from controlplane import celery_app
from controlplane.dispatch.models import OutboxMessage
from tests.controlplane.conftest import PASSWORD
from tests.controlplane.dashboard.builders import to_awaiting_approval

# CI installs it with `apt-get install -y chromium` (Debian); Playwright's own
# downloads are not reachable there.
CHROMIUM = os.environ.get("RELEASEGATE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Short, so a missing element fails the test in seconds rather than 30 s (10 s:
# these machines are shared, and a busy one takes seconds to render a page).
TIMEOUT_MS = 10_000
# Waits that are slow for a reason: the first parse of plotly.js (~4.8 MB) takes
# seconds on a busy 2-core machine, and live regions refresh every 2-3 s.
CHARTS_TIMEOUT_MS = 30_000
LIVE_TIMEOUT_MS = 15_000
WORKER = "system:worker"


@pytest.fixture(scope="package")
def browser():
    """One Chromium for all browser tests. Package-scoped rather than session-scoped:
    Playwright's sync API keeps an asyncio loop running in this thread while it is
    up, which would break later tests (outside this folder) that call asyncio.run."""
    if not Path(CHROMIUM).is_file():
        pytest.fail(
            f"Chromium not found at {CHROMIUM}; the dashboard browser tests need it. "
            "Install it (Debian/Ubuntu: apt-get install -y chromium) or point "
            "RELEASEGATE_CHROMIUM at a Chromium binary.",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    # That running loop also makes Django refuse ORM calls from this thread unless
    # told they are safe; they are: the test, not an event loop, makes them.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            yield chromium
            chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser, live_server):
    """A page in a fresh browser context (no cookies shared between tests)."""
    context = browser.new_context(base_url=live_server.url)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    yield page
    context.close()


@pytest.fixture
def log_in(page):
    def log_in(username: str, password: str = PASSWORD) -> None:
        page.goto("/accounts/login/")
        page.get_by_label("Username").fill(username)
        page.get_by_label("Password").fill(password)
        # click() does not wait for the POST's answer; the caller reads page.url.
        with page.expect_navigation():
            page.get_by_role("button", name="Log in").click()

    return log_in


@pytest.fixture
def outbox(settings) -> Callable[[], list[tuple[str, tuple]]]:
    """outbox() -> every task queued and not yet run, as (task name, args), oldest
    first. Publishing on commit is off, so nothing reaches a broker."""
    settings.RELEASEGATE_OUTBOX_PUBLISH_ON_COMMIT = False

    def pending() -> list[tuple[str, tuple]]:
        messages = OutboxMessage.objects.filter(sent__isnull=True).order_by("id")
        return [(m.task.rsplit(".", 1)[-1], tuple(m.args)) for m in messages]

    return pending


def _agent_deployed(request: dict, agent) -> str:
    """What the enrolled `agent` (a gpuagent.worker.Agent) answers a deploy job
    with once it verified the candidate and its server answers /health (these
    releases have no files: their evidence is built), sealed with its key;
    returns the release's state after the control plane recorded it."""
    from controlplane.releases.models import Release
    from controlplane.releases.tasks import record_job_result
    from gpuagent import tasks
    from gpuagent.protocol import DeployResult, JobRequest, JobResult

    job = JobRequest.model_validate(request)
    assert job.kind == "deploy", job.kind
    result = JobResult(
        job_id=job.job_id,
        kind=job.kind,
        ok=True,
        agent=agent.name,
        payload=DeployResult(ok=True, endpoint="http://127.0.0.1:8100").model_dump(),
    )
    record_job_result(*tasks.sealed_result(result, job, agent))
    return Release.objects.get(pk=job.release_id).state


@pytest.fixture
def run_queued(outbox, tmp_path):
    """Run what was queued, oldest first, through the real task code; agent jobs
    are answered as an enrolled agent would (`_agent_deployed`). Returns the
    outcome of each control-plane task."""
    from gpuagent import tasks
    from gpuagent.artifacts import ArtifactStore
    from tests.controlplane.conftest import enroll

    agent = tasks.Agent(
        name="gpu-1",
        store=ArtifactStore(tmp_path / "gpu-1"),
        signing_key=None,
        trusted_keys=(),
        controlplane_queue="celery",
        pool_queue="agents",
        threads=1,
    )
    enrolled = []

    def run() -> list[str]:
        celery_app.loader.import_default_modules()  # registers the tasks by name
        if not enrolled:
            enrolled.append(enroll(agent))
        outcomes = []
        while message := OutboxMessage.objects.filter(sent__isnull=True).first():
            OutboxMessage.objects.filter(pk=message.pk).update(sent=timezone.now())
            if message.task == "gpuagent.run_job":
                outcomes.append(_agent_deployed(message.args[0], agent))
            else:
                outcomes.append(celery_app.tasks[message.task](*message.args))
        return outcomes

    return run


@pytest.fixture
def awaiting_approval(make_release):
    """make(version=None, **builder options) -> a release the worker took through
    the pipeline to awaiting_approval with recorded evidence (quality and load
    reports, manifest, gates), every move through the actions the worker uses."""

    def make(version=None, *, target_environment=None, recipe=None, **options):
        release = make_release(
            version, target_environment=target_environment, recipe=recipe
        )
        return to_awaiting_approval(release, **options)

    return make


@pytest.fixture
def screenshot():
    """screenshot(page, name): a full-page PNG named `name`-`width`.png in
    var/test-artifacts/screenshots (git ignores var/), or in
    $RELEASEGATE_SCREENSHOTS."""
    default = Path(settings.BASE_DIR) / "var" / "test-artifacts" / "screenshots"
    folder = Path(os.environ.get("RELEASEGATE_SCREENSHOTS", default))
    folder.mkdir(parents=True, exist_ok=True)

    def take(page, name: str) -> Path:
        path = folder / f"{name}-{page.viewport_size['width']}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take
