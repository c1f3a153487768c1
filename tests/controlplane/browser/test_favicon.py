"""A browser loads the icon a dashboard page names, and nothing it asks for on a
first page is missing."""

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_it_loads_the_icon_and_nothing_is_missing(page, log_in, owner):
    answers = []
    page.on("response", lambda response: answers.append(response))

    log_in("alice")
    page.wait_for_load_state("networkidle")

    assert [f"{a.status} {a.url}" for a in answers if a.status >= 400] == []
    icons = [a for a in answers if "favicon" in a.url]
    assert icons and all(a.ok for a in icons), [(a.status, a.url) for a in icons]
    assert page.evaluate("async () => (await fetch('/favicon.ico')).ok")
