import pytest
from playwright.sync_api import expect

from tests.controlplane.conftest import PASSWORD

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_it_logs_the_owner_in_and_lists_the_team_release(
    page, live_server, log_in, owner, release
):
    log_in("alice")

    assert page.url == f"{live_server.url}/"
    expect(page.locator("header")).to_contain_text("alice")
    link = page.get_by_role("link", name=str(release))
    expect(link).to_have_attribute("href", f"/releases/{release.pk}/")
    row = page.get_by_role("row").filter(has=link)
    expect(row).to_contain_text("acme")
    expect(row).to_contain_text("registered")


def test_it_shows_an_error_for_a_wrong_password(page, live_server, log_in, owner):
    log_in("alice", "not-the-password")

    assert page.url.startswith(f"{live_server.url}/accounts/login/")
    expect(page.get_by_text("Wrong username or password.")).to_be_visible()
    assert "sessionid" not in {c["name"] for c in page.context.cookies()}
    page.goto("/")
    assert page.url.startswith(f"{live_server.url}/accounts/login/")


def test_it_sends_anonymous_visitors_to_login_and_back(
    page, live_server, owner, release
):
    detail = f"/releases/{release.pk}/"

    page.goto(detail)

    assert page.url == f"{live_server.url}/accounts/login/?next={detail}"
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()
    assert str(release) not in page.content()
    page.get_by_label("Username").fill("alice")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(f"{live_server.url}{detail}")
    expect(page.get_by_role("heading", level=1)).to_contain_text(str(release))


def test_it_logs_out(page, live_server, log_in, owner):
    log_in("alice")

    page.get_by_role("button", name="Log out").click()

    expect(page).to_have_url(f"{live_server.url}/accounts/login/")
    page.goto("/")
    assert page.url.startswith(f"{live_server.url}/accounts/login/")


# WCAG 2 contrast ratio of an element's text against the first opaque background
# behind it (its own, or an ancestor's when its own is transparent).
CONTRAST_JS = """(element) => {
    const rgb = (css) => css.match(/[\\d.]+/g).map(Number);
    const luminance = ([r, g, b]) => {
        const lin = (c) => {
            c /= 255;
            return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
        };
        return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
    };
    let node = element, background = [255, 255, 255];
    while (node && node.nodeType === 1) {
        const parts = rgb(getComputedStyle(node).backgroundColor);
        if (parts.length === 3 || parts[3] > 0) { background = parts; break; }
        node = node.parentElement;
    }
    const [a, b] = [rgb(getComputedStyle(element).color), background].map(luminance);
    return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
}"""


def test_it_shows_a_readable_log_out_button(page, log_in, owner):
    log_in("alice")

    button = page.get_by_role("button", name="Log out")

    # 4.5:1 is WCAG AA for normal text.
    assert button.evaluate(CONTRAST_JS) >= 4.5
