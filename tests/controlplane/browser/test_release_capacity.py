"""The release page in a real browser with a live release to compare with: every
chart drawn with data, candidate and live on the same axes where both are
measured, the SLO of the gate policy in force, and the capacity plan table."""

import pytest
from playwright.sync_api import expect

from controlplane.dashboard.release_page import PERFORMANCE_CHARTS, QUALITY_CHARTS
from controlplane.releases.actions.gate_policies import do_update_gate_policy
from tests.controlplane.browser.conftest import CHARTS_TIMEOUT_MS
from tests.controlplane.dashboard.builders import WORKLOADS, set_price, take_live

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# (name, trace names) of every trace of every chart drawn on the page.
TRACES_JS = """() => [...document.querySelectorAll("[data-chart]")].map((div) => [
    div.id.replace("chart-", ""),
    (div.data || []).map((t) => [t.name, (t.x || []).length, (t.y || []).length]),
])"""
CHARTS_DRAWN_JS = """() => [...document.querySelectorAll("[data-chart]")]
    .every((div) => div.querySelector(".main-svg"))"""
WORKLOAD_CURVES = tuple(f"load-{i}" for i in range(len(WORKLOADS)))
# Charts that put each release of the page on the same axes.
BOTH_SIDES = ("context", "goodput", "reuse", "cost", *WORKLOAD_CURVES)


def test_it_draws_every_chart_for_candidate_and_live_and_the_capacity_plan(
    page, log_in, owner, teammate, environment, awaiting_approval, screenshot
):
    set_price(environment, owner, target_requests_per_s={"chat": 40.0, "rag": 4.0})
    do_update_gate_policy(
        environment,
        {"load": {"per_workload": {"chat": {"max_tpot_p99_ms": 45}}}},
        actor=owner,
    )
    live = take_live(awaiting_approval("0.9.0", speed=0.8), teammate)
    candidate = awaiting_approval("1.0.0", speed=1.3)
    log_in("bob")

    page.goto(f"/releases/{candidate.pk}/")
    page.wait_for_function(CHARTS_DRAWN_JS, timeout=CHARTS_TIMEOUT_MS)

    drawn = dict(page.evaluate(TRACES_JS))
    expected = {*PERFORMANCE_CHARTS, *QUALITY_CHARTS, *WORKLOAD_CURVES, "timeline"}
    assert set(drawn) == expected
    for name, traces in drawn.items():
        assert traces and all(x and y for _, x, y in traces), name
    for name in BOTH_SIDES:
        names = " ".join(trace_name for trace_name, _, _ in drawn[name])
        assert f"candidate {candidate.version}" in names, name
        assert f"live {live.version}" in names, name
    memory_x = page.locator("#chart-memory").evaluate("(div) => div.data[0].x")
    assert memory_x[-1] == f"live {live.version}"
    chat = page.locator("#chart-load-0")
    expect(chat.locator(".gtitle")).to_contain_text("chat:")
    slo = chat.evaluate(
        """(div) => div.data.filter((t) => t.name === "SLO (gate policy)")
            .map((t) => [t.yaxis, t.y[0]])"""
    )
    assert sorted(slo) == [["y2", 2000], ["y3", 45]]
    knees = chat.evaluate(
        "(div) => div.data.filter((t) => t.name.startsWith('knee')).length"
    )
    assert knees == 2

    table = page.locator("#capacity")
    expect(table).to_be_visible()
    rows = table.locator("tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.nth(0).locator("td").first).to_have_text("chat")
    expect(rows.nth(1).locator("td").first).to_have_text("rag")
    for index in range(2):
        cells = rows.nth(index).locator("td")
        expect(cells).to_have_count(12)  # workload, target, 4 + 4, two differences
        assert all(text.strip() != "—" for text in cells.all_inner_texts())
    expect(table.locator("tfoot")).to_contain_text("all (one shared pool)")
    expect(table.locator("thead")).to_contain_text(f"Live {live.version}")
    expect(page.locator(".price-warning")).to_have_count(0)
    expect(page.locator("#device-hour-cost")).to_have_text("2.50 USD")
    screenshot(page, "release-capacity")

    page.get_by_label("Target traffic, requests/s per workload").fill("code:3")
    page.get_by_role("button", name="Plan").click()

    expect(table.locator("tbody tr")).to_have_count(1)
    expect(table.locator("tbody tr td").first).to_have_text("code")
