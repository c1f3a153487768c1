"""Serves plotly.js from the `plotly` package's own copy, so the charts need no CDN
and the repository carries no multi-megabyte vendored file: the version comes with
the pinned dependency, and the file keeps its MIT licence header.

One file, one URL: `{% static PLOTLY_JS %}`. `collectstatic` copies it too (list()).
"""

from importlib.util import find_spec
from pathlib import Path

from django.contrib.staticfiles.finders import BaseFinder
from django.core.checks import Error
from django.core.files.storage import FileSystemStorage

PLOTLY_JS = "vendor/plotly/plotly.min.js"


def plotly_js_path() -> Path | None:
    """Where the installed plotly package keeps plotly.min.js, without importing it."""
    spec = find_spec("plotly")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "package_data" / "plotly.min.js"


class PlotlyFinder(BaseFinder):
    def check(self, **kwargs):
        path = plotly_js_path()
        if path is None or not path.is_file():
            return [
                Error(
                    f"plotly.min.js not found (looked in {path}); the dashboard's "
                    "charts need the 'plotly' package installed",
                    id="dashboard.E001",
                )
            ]
        return []

    def find(self, path, find_all=False, **kwargs):
        found = plotly_js_path()
        if path != PLOTLY_JS or found is None or not found.is_file():
            return []
        return [str(found)] if find_all else str(found)

    def list(self, ignore_patterns):
        found = plotly_js_path()
        if found is None or not found.is_file():
            return
        storage = FileSystemStorage(location=found.parent)
        storage.prefix = str(Path(PLOTLY_JS).parent)
        yield found.name, storage
