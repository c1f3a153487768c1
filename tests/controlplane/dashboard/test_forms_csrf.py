"""Every form a dashboard page renders that posts carries the CSRF token, and every
page sets the viewport for phones."""

import re

import pytest

from controlplane.accounts.actions import do_create_api_token

PAGES = (
    "/",
    "/environments/",
    "/fleet/",
    "/cost/",
    "/audit/",
    "/tokens/",
    "/tokens/new/",
)
POST_FORM = re.compile(r'<form[^>]*method="post"[^>]*>(.*?)</form>', re.S)


@pytest.fixture
def pages(client, teammate, team, make_live, awaiting):
    do_create_api_token(teammate, team, "bob-ci", ["read"])
    make_live("0.9.0")
    make_live("0.9.5")
    candidate = awaiting("1.0.0")
    client.force_login(teammate)
    return (*PAGES, f"/releases/{candidate.pk}/")


def test_it_puts_the_csrf_token_in_every_post_form(client, pages):
    forms = 0
    for url in pages:
        body = client.get(url).content.decode()
        for form in POST_FORM.findall(body):
            forms += 1
            assert 'name="csrfmiddlewaretoken"' in form, url
    # log out on each page, approve, reject and re-measure, one rollback form, a new
    # token, revoke bob-ci
    assert forms == len(pages) + 6


def test_it_sets_the_viewport_on_every_page(client, pages):
    for url in (*pages, "/accounts/login/"):
        body = client.get(url).content.decode()
        assert 'name="viewport" content="width=device-width, initial-scale=1"' in body
