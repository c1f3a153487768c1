"""The layering in STYLE.md, checked on the source: torch stays out of the control
plane, Django stays out of the agent and the kernels, the serving engine imports
neither the evaluator nor the compressor, and the agent's benches (which drive several
layers) live in gpuagent/benches/, imported by nothing outside it but the tests."""

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    """Each module's absolute imports: `import a.b` gives a.b, `from a import b`
    both a and a.b (b may be a module)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(packages: tuple[str, ...], bad: Callable[[str, str], bool]) -> list[str]:
    """ "path: name" for each import `name` in `packages` for which bad(path, name)."""
    return [
        f"{path}: {name}"
        for package in packages
        for path, names in imported_modules(package).items()
        for name in sorted(names)
        if bad(path, name)
    ]


def is_within(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("controlplane", ("torch", "triton", "kernels")),
        ("gpuagent", ("django", "controlplane", "ninja")),
        ("kernels", ("django", "controlplane", "gpuagent", "ninja")),
    ],
)
def test_it_keeps_layers_apart(package, forbidden):
    assert offenders((package,), lambda _, name: name.split(".")[0] in forbidden) == []


def test_it_lets_controlplane_import_only_torch_free_agent_modules():
    allowed = ("gpuagent.protocol", "gpuagent.integrity", "gpuagent.sizing")

    def bad(_, name):
        return name.startswith("gpuagent") and not name.startswith(allowed)

    assert offenders(("controlplane",), bad) == []


def test_it_keeps_torch_out_of_the_agent_modules_the_control_plane_imports():
    code = (
        "import sys, gpuagent.protocol, gpuagent.integrity, gpuagent.sizing; "
        "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_it_keeps_the_engine_off_the_evaluator_and_the_compressor():
    forbidden = ("gpuagent.evaluate", "gpuagent.compress")

    def bad(_, name):
        return any(is_within(name, module) for module in forbidden)

    assert offenders(("gpuagent/engine",), bad) == []


def test_it_keeps_the_agents_benches_in_gpuagent_benches():
    benches = ROOT / "gpuagent" / "benches"
    elsewhere = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "gpuagent").rglob("*.py"))
        if (path.name == "bench.py" or path.stem.endswith("_bench"))
        and benches not in path.parents
    ]
    assert elsewhere == []


def test_it_lets_nothing_outside_the_benches_import_a_bench():
    def bad(path, name):
        is_bench = is_within(name, "gpuagent.benches") or name.endswith(
            (".bench", "_bench")
        )
        return is_bench and not path.startswith("gpuagent/benches/")

    assert offenders(("controlplane", "gpuagent", "kernels"), bad) == []


def import_cycles(package: str) -> list[list[str]]:
    """The groups of `package`'s modules that import each other round in a circle
    (strongly connected components of more than one module), imports inside
    functions included: a lazy import hides a circle, it does not break it."""
    modules = {
        path.removesuffix(".py").removesuffix("/__init__").replace("/", "."): names
        for path, names in imported_modules(package).items()
        if "/migrations/" not in path
    }
    graph = {
        m: {n for n in names if n in modules and n != m} for m, names in modules.items()
    }
    order, lowest, stack, cycles = {}, {}, [], []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        stack.append(module)
        for other in graph[module]:
            if other not in order:
                visit(other)
                lowest[module] = min(lowest[module], lowest[other])
            elif other in stack:
                lowest[module] = min(lowest[module], order[other])
        if lowest[module] == order[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_it_keeps_the_control_plane_free_of_import_cycles():
    assert import_cycles("controlplane") == []
