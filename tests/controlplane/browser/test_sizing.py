"""A release manager sizes a Kimi K2 deployment from the dashboard with nothing but
its published config.json: pasted into the Sizing page, 8 x 141 GiB, w4a16, fp8 KV,
the report and the vLLM command come back."""

from pathlib import Path

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

KIMI = (
    Path(__file__).resolve().parents[2] / "data" / "configs" / "kimi-k2-instruct.json"
)


def test_it_sizes_kimi_k2_from_a_pasted_config(page, log_in, member, screenshot):
    log_in("carol")
    page.get_by_role("link", name="Sizing").click()
    page.get_by_label("config.json").fill(KIMI.read_text())
    page.get_by_label("GPU memory (GiB)").fill("141")
    page.get_by_label("Devices").fill("8")
    page.get_by_label("Context (tokens)").fill("65536")
    page.get_by_label("Weights").select_option("w4a16-g128")
    page.get_by_label("KV cache dtype").select_option("fp8")
    page.get_by_role("button", name="Size it").click()

    report = page.locator("#sizing-report")
    expect(report.get_by_role("heading", level=2).first).to_have_text(
        "kimi_k2: 1,026.41 B parameters, 32.86 B active per token"
    )
    bf16 = page.locator("#kv tbody tr").first.locator("td")
    expect(bf16.nth(0)).to_have_text("bf16")
    expect(bf16.nth(1)).to_have_text("70272")  # 61 layers x (512 + 64) x 2
    command = page.locator("#vllm-command")
    expect(command).to_contain_text("--tensor-parallel-size 8")
    expect(command).to_contain_text("--enable-expert-parallel")
    expect(command).to_contain_text("--kv-cache-dtype fp8")
    # the knobs stay as picked for the next try
    expect(page.get_by_label("Weights")).to_have_value("w4a16-g128")
    screenshot(page, "sizing-kimi-k2")
