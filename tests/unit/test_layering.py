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


ENGINE = "skulk.engines.torch"
RUNTIME = tuple(f"{ENGINE}.{m}" for m in ("core", "flight", "admission", "step", "local_step", "engine", "journal",
                                           "timing", "links", "wire", "drafter", "fallback", "model", "loader",
                                           "executor", "options", "scheduler"))
"""The torch engine's runtime: what runs a model and its requests, above the model families and the scheduler."""
ENGINE_FLOORS = {
    # module prefix: what it must not import (anywhere in its body), so the floors inside the engine hold
    f"{ENGINE}.models": RUNTIME,  # a family is its layers on shared building blocks, never the engine around it
    f"{ENGINE}.scheduler": ("torch", *RUNTIME[:-1], f"{ENGINE}.cache", f"{ENGINE}.layers", f"{ENGINE}.requests"),
    f"{ENGINE}.header": ("torch", *RUNTIME),
    # the executor runs what a header names over tensors: no request bookkeeping, nothing of the engine above it
    f"{ENGINE}.executor": (f"{ENGINE}.scheduler", f"{ENGINE}.header", *RUNTIME[:8]),
}


def _absolute_imports(path: Path, module: str) -> set[str]:
    """Every module `path` imports, relative imports resolved against `module` (its dotted name)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            head = ".".join(p for p in (base, node.module or "") if p)
            names.add(head)
            names.update(f"{head}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("prefix", sorted(ENGINE_FLOORS))
def test_the_engines_floors(prefix: str) -> None:
    """Inside the torch engine too, dependencies point down: the model families import building blocks only, and
    the scheduler and its header no torch and nothing that holds tensors, the executor no scheduler and nothing of
    the engine above it (issue 39)."""
    files = [p for p in SRC.rglob("*.py") if _module_name(p) == prefix or _module_name(p).startswith(prefix + ".")]
    assert files, prefix
    bad = [f"{_module_name(p)} imports {name}" for p in files for name in sorted(_absolute_imports(p, _module_name(p)))
           if any(name == f or name.startswith(f + ".") for f in ENGINE_FLOORS[prefix])]
    assert bad == []


def test_relative_imports_resolve() -> None:
    path = SRC / "engines" / "torch" / "models" / "llama.py"
    found = _absolute_imports(path, _module_name(path))
    assert {f"{ENGINE}.layers", f"{ENGINE}.layers.DecoderLayer", f"{ENGINE}.models.family"} <= found
