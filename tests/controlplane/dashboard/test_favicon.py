"""The site's icon: named by every dashboard page (base.html) and served at
/favicon.ico, the URL browsers try on a first visit and on pages that name none
(the admin, the API docs). Over real HTTP: the live server serves static files."""

import re
import struct

import httpx
from django.contrib.staticfiles import finders

from controlplane.dashboard.views.favicon import FAVICON

ICON_LINK = re.compile(r'<link rel="icon" href="([^"]+)"')
ICO_HEADER = struct.pack("<HHH", 0, 1, 1)  # reserved, type 1 (icon), one image


def test_it_serves_the_icon_at_favicon_ico(live_server):
    response = httpx.get(f"{live_server.url}/favicon.ico", follow_redirects=True)

    assert response.status_code == 200
    assert response.headers["Content-Type"] in (
        "image/x-icon",
        "image/vnd.microsoft.icon",
    )
    assert response.content.startswith(ICO_HEADER)
    assert response.content == open(finders.find(FAVICON), "rb").read()
    assert response.history[0].status_code == 302  # not cached forever


def test_it_names_its_icons_on_every_page(live_server, db):
    page = httpx.get(f"{live_server.url}/accounts/login/")

    hrefs = ICON_LINK.findall(page.text)

    assert len(hrefs) == 2
    for href in hrefs:
        icon = httpx.get(f"{live_server.url}{href}")
        assert icon.status_code == 200, href
        assert icon.headers["Content-Type"].startswith("image/"), href
