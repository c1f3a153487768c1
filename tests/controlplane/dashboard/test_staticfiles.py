from pathlib import Path

import httpx
from django.contrib.staticfiles import finders
from django.core.management import call_command

from controlplane.dashboard.staticfiles import PLOTLY_JS, PlotlyFinder, plotly_js_path


def test_it_finds_plotly_js_in_the_installed_package():
    found = finders.find(PLOTLY_JS)

    assert found == str(plotly_js_path())
    head = Path(found).read_bytes()[:200]
    assert b"plotly.js v" in head and b"MIT" in head


def test_it_serves_plotly_js_locally(live_server):
    response = httpx.get(f"{live_server.url}/static/{PLOTLY_JS}")

    assert response.status_code == 200
    assert response.content == plotly_js_path().read_bytes()


def test_it_finds_nothing_else():
    assert PlotlyFinder().find("vendor/plotly/package_data/datasets/iris.csv.gz") == []
    assert PlotlyFinder().find(PLOTLY_JS, find_all=True) == [str(plotly_js_path())]


def test_it_is_collected_by_collectstatic(tmp_path, settings):
    settings.STATIC_ROOT = tmp_path

    call_command("collectstatic", interactive=False, verbosity=0)

    collected = tmp_path / PLOTLY_JS
    assert collected.read_bytes() == plotly_js_path().read_bytes()


def test_it_reports_a_missing_plotly_package(monkeypatch):
    monkeypatch.setattr(
        "controlplane.dashboard.staticfiles.find_spec", lambda name: None
    )

    (error,) = PlotlyFinder().check()

    assert error.id == "dashboard.E001"
    assert PlotlyFinder().find(PLOTLY_JS) == []
