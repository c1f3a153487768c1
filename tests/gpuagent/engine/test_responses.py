"""How answers are written (gpuagent.engine.responses), apart from the server."""

import ast
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
