"""How answers are written (gpuagent.engine.responses), apart from the server."""

import ast
import json
from pathlib import Path

import gpuagent.engine.responses as responses


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at run time or for type checking alike."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_it_knows_nothing_of_the_server_that_uses_it():
    imported = imported_modules(Path(responses.__file__))

    assert "gpuagent.engine.server" not in imported
    assert "gpuagent.engine.openai_api" in imported


def test_an_event_stays_one_line_for_a_splitlines_reader():
    # httpx's aiter_lines (guidellm's reader) splits where str.splitlines does,
    # U+2028, U+2029 and U+0085 included; a demo model writes such characters
    content = "a\u2028b\u2029c\x85d\u00e9\ud55c"
    event = responses.sse({"choices": [{"delta": {"content": content}}]})

    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1
    assert json.loads(lines[0].removeprefix("data: ")) == {
        "choices": [{"delta": {"content": content}}]
    }
    assert "\u00e9\ud55c" in event  # other characters stay raw (UTF-8)
