import pytest
from playwright.sync_api import expect

from controlplane.releases.models import Release

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_it_shows_the_outsider_none_of_the_team(
    page, log_in, outsider, environment, awaiting_approval
):
    release = awaiting_approval()

    log_in("mallory")

    expect(page.locator("header")).to_contain_text("mallory")
    expect(page.locator("#releases")).to_contain_text("No releases yet.")
    for url in ("/", "/environments/", "/cost/", "/audit/", "/fleet/"):
        page.goto(url)
        body = page.content()
        assert str(release) not in body, url
        assert str(environment) not in body, url
        assert f"/releases/{release.pk}/" not in body, url


def test_it_answers_404_to_the_outsider_on_a_direct_url(
    page, log_in, outsider, awaiting_approval
):
    release = awaiting_approval()
    log_in("mallory")

    response = page.goto(f"/releases/{release.pk}/")

    assert response.status == 404
    assert str(release) not in page.content()
    assert release.manifest_digest not in page.content()
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
