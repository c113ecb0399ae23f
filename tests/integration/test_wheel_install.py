"""The built wheel is a working `skulk`: what `make dist` builds, installed into a fresh venv, starts a node that
serves its dashboard and its API, and places and runs the demo model from the installed files alone.

The tests run from the source tree (PYTHONPATH=src or an editable install), so a file missing from the wheel's
package data (a dashboard module, a model card, a kernel source) would go unnoticed by every other test. This
one builds the wheel from a copy of the tree, installs it with `--no-deps` into a new venv, and gives that venv
the project's dependencies offline through a .pth line naming this interpreter's site-packages: a plain path
line does not run the editable install's hook kept there, so `skulk` is imported from the wheel's copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from skulk.testing.nodes import LocalNode

from .harness import place_and_wait

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "skulk"
pytestmark = pytest.mark.timeout(240)
CLEAN_ENV = {"PYTHONPATH": ""}
"""An empty PYTHONPATH is no PYTHONPATH: the test's own src/ must not shadow the installed copy."""


def run(cmd: list[str | Path]) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **CLEAN_ENV})
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def build_wheel(tmp: Path) -> Path:
    """As `make dist` does (offline, with this venv's setuptools), from a copy so the tree gets no build/."""
    tree = tmp / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copy(ROOT / "README.md", tree)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", tmp / "dist", tree])
    (wheel,) = (tmp / "dist").glob("skulk-*.whl")
    return wheel


def data_files() -> set[str]:
    """Every file the package reads at run time besides its modules (dashboard, model cards, kernel sources)."""
    return {
        p.relative_to(PACKAGE.parent).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }


def install(wheel: Path, venv: Path) -> Path:
    """A fresh venv with the wheel in it and the project's dependencies borrowed from this interpreter."""
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel])
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_skulk_test_deps.pth").write_text("".join(f"{path}\n" for path in ours))
    return venv / "bin" / "skulk"


@dataclass
class InstalledNode(LocalNode):
    """A LocalNode started from the installed `skulk` entry point instead of `python -m skulk` of this tree."""

    entry: Path = Path()

    def command(self) -> list[str]:
        harness = super().command()
        assert harness[1:3] == ["-m", "skulk"], harness
        return [str(self.entry), *harness[3:]]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert data_files() <= names, f"missing from the wheel: {sorted(data_files() - names)}"
    return install(wheel, tmp / "venv")


@pytest.fixture
def node(installed: Path, tmp_path: Path) -> Iterator[InstalledNode]:
    started = InstalledNode(home=tmp_path / "home", cluster=f"wheel-{tmp_path.name}", extra_env=CLEAN_ENV,
                            entry=installed)
    try:
        yield started.start()
    finally:
        started.stop()
        assert started.reap_leftovers() == [], "processes outlived the installed node"
        assert not started.alive


def test_the_installed_package_is_the_one_imported(installed: Path) -> None:
    venv = installed.parent.parent
    code = "import skulk, skulk.dashboard as d; print(skulk.__file__); print(d.STATIC_DIR)"
    module, static = run([venv / "bin" / "python", "-c", code]).split()
    assert Path(module).is_relative_to(venv), module
    assert (Path(static) / "index.html").is_file()


def test_a_node_from_the_wheel_serves_the_dashboard_the_api_and_a_model(node: InstalledNode) -> None:
    node.wait_ready(90)
    with httpx.Client(base_url=node.url, timeout=30, trust_env=False) as client:
        index = client.get("/")
        assert index.status_code == 200 and "<html" in index.text.lower()
        assert "/assets/" in index.text, index.text[:500]
        prefix = index.text.split("/assets/")[1].split("/")[0]
        script = client.get(f"/assets/{prefix}/js/main.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert client.get("/v1/models").status_code == 200
        place_and_wait(node)
        reply = client.post("/v1/chat/completions", json={
            "model": "skulk/tiny-random-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    runners = node.runner_pids()
    assert runners, "the placed model has no runner process"
    venv = str(node.entry.parent.parent)
    assert all(psutil.Process(pid).cmdline()[0].startswith(venv) for pid in runners)
