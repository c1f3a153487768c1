"""A newcomer gets an API token without a shell on the server: signed in, they
make one on the Tokens page, copy its secret from the answer, and call the API
with it over real HTTP; the secret is shown that once; revoked on the same page,
it is refused (401)."""

import httpx
import pytest
from playwright.sync_api import expect

from controlplane.accounts.models import ApiToken

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_it_makes_a_working_token_shown_once_then_revokes_it(
    page, log_in, live_server, member, release
):
    log_in("carol")
    page.get_by_role("link", name="Tokens").click()
    page.get_by_role("link", name="New token").click()
    page.get_by_label("Name").fill("carol-laptop")
    page.get_by_label("promote:").check()
    page.get_by_role("button", name="Create token").click()
    expect(page.get_by_role("heading", level=1)).to_have_text(
        "Token carol-laptop created"
    )
    secret = page.locator("#token-secret").inner_text().strip()

    api = httpx.Client(
        base_url=f"{live_server.url}/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
    )
    response = api.get("/releases")
    assert response.status_code == 200, response.text
    assert [r["id"] for r in response.json()["items"]] == [release.pk]
    assert ApiToken.objects.get(name="carol-laptop").scopes == ["read", "promote"]

    page.goto("/tokens/")
    row = page.locator("#tokens tr", has_text="carol-laptop")
    expect(row).to_contain_text(f"{secret[:8]}…")
    assert secret not in page.content()
    row.get_by_role("button", name="Revoke…").click()
    page.get_by_role("button", name="Confirm revoking carol-laptop").click()
    expect(page.locator(".messages")).to_contain_text("it no longer works")
    expect(page.locator("#tokens tr", has_text="carol-laptop")).to_contain_text(
        "revoked"
    )

    refused = api.get("/releases")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "not_authenticated"
