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
    "cluster": ("skulk.api", "skulk.node"),
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
