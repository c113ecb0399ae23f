"""The node process's imports: torch stays in runner processes (the node never runs a model)."""

from __future__ import annotations

import subprocess
import sys

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
