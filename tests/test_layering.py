"""The layering in STYLE.md, checked on the source: torch stays out of the control
plane, Django stays out of the agent and the kernels."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path}: {name}"
        for path, names in imported_modules(package).items()
        for name in sorted(names)
        if name.split(".")[0] in forbidden
    ]


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("controlplane", ("torch", "triton", "kernels")),
        ("gpuagent", ("django", "controlplane", "ninja")),
        ("kernels", ("django", "controlplane", "gpuagent", "ninja")),
    ],
)
def test_it_keeps_layers_apart(package, forbidden):
    assert offenders(package, forbidden) == []


def test_it_lets_controlplane_import_only_torch_free_agent_modules():
    allowed = ("gpuagent.protocol", "gpuagent.integrity")
    bad = [
        f"{path}: {name}"
        for path, names in imported_modules("controlplane").items()
        for name in sorted(names)
        if name.startswith("gpuagent") and not name.startswith(allowed)
    ]
    assert bad == []
