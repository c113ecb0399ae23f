"""Layering: torch stays in runner processes (the node never runs a model), and dependencies point down."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def _modules_after(statement: str) -> set[str]:
    """Modules loaded by a fresh interpreter after `statement` (a fresh one: this test process has torch)."""
    code = f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=50)
    return set(out.stdout.split())


def test_the_node_process_does_not_import_torch() -> None:
    loaded = _modules_after("import skulk.node")
    assert "skulk.node" in loaded
    assert "torch" not in loaded
    assert not any(m.startswith("skulk.engines.torch") for m in loaded)


SRC = Path(__file__).resolve().parents[2] / "src" / "skulk"

FORBIDDEN = {
    # package: packages it must not import (dependencies point down)
    "types": ("skulk.api", "skulk.node", "skulk.master", "skulk.worker", "skulk.runner", "skulk.store",
              "skulk.cluster", "skulk.models", "skulk.engines"),
    "store": ("skulk.api", "skulk.node", "skulk.models"),
    "formats": ("skulk.api", "skulk.node", "skulk.master", "skulk.worker", "skulk.runner", "skulk.store",
                "skulk.cluster", "skulk.models", "skulk.engines", "skulk.state"),
    "cluster": ("skulk.api", "skulk.node"),
    "engines": ("skulk.api", "skulk.node", "skulk.master", "skulk.worker", "skulk.cluster", "skulk.store"),
    "master": ("skulk.api", "skulk.node"),
    "state": ("skulk.api", "skulk.node", "skulk.master", "skulk.worker"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_import(package: str) -> None:
    bad = [f"{path.relative_to(SRC)} imports {name}"
           for path in sorted((SRC / package).rglob("*.py"))
           for name in sorted(_imports(path))
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package])]
    assert bad == []


def _module_name(path: Path) -> str:
    parts = ("skulk", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """skulk module -> the skulk modules it imports anywhere in its body (a lazy import inside a function or under
    TYPE_CHECKING counts too: it still ties the two modules together). `from pkg import mod` names the module."""
    modules = {_module_name(path): path for path in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_between_modules() -> None:
    assert _cycles(_import_graph()) == []
