"""The MLX probe's kept answer (engines/mlx/probe_cache.py): read back under the same key, asked again when
anything it depends on changed, when the file is damaged, and after a failed probe (never kept)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from skulk.engines import mlx as mlx_engine
from skulk.engines.mlx import probe_cache

ANSWER: dict[str, Any] = {"version": "0.0-test", "modules": ["llama", "qwen3"], "remapping": {"mistral": "llama"}}


def test_an_answer_is_read_back_under_its_key(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "mlx-probe.json"
    assert probe_cache.read(path) is None
    probe_cache.write(path, ANSWER)
    registry = probe_cache.read(path)
    assert registry is not None and registry.version == "0.0-test" and "qwen3" in registry.modules
    assert not list(path.parent.glob("*.tmp"))


def test_another_host_python_or_package_asks_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mlx-probe.json"
    probe_cache.write(path, ANSWER)
    monkeypatch.setattr(probe_cache.sys, "executable", "/another/python")
    assert probe_cache.read(path) is None
    monkeypatch.undo()
    assert probe_cache.read(path) is not None
    monkeypatch.setattr(probe_cache, "PACKAGES", (*probe_cache.PACKAGES, "pip"))  # a version that differs
    assert probe_cache.read(path) is None


@pytest.mark.parametrize("text", ["", "{not json", "[]", '{"key": 1}', '{"answer": {}}'])
def test_a_damaged_file_asks_again(tmp_path: Path, text: str) -> None:
    path = tmp_path / "mlx-probe.json"
    path.write_text(text)
    assert probe_cache.read(path) is None


def test_probed_reads_the_kept_answer_and_never_keeps_a_failure(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mlx-probe.json"
    monkeypatch.setattr(mlx_engine, "PROBE_CACHE", path)
    calls: list[object] = []

    def failing(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return subprocess.CompletedProcess([str(a) for a in args], 1, "", "RuntimeError: no device\n")

    monkeypatch.setattr(mlx_engine.subprocess, "run", failing)
    mlx_engine.probed.cache_clear()
    try:
        assert mlx_engine.probe() == "RuntimeError: no device" and len(calls) == 1
        assert not path.exists()  # a failure is asked again at the next start
        probe_cache.write(path, ANSWER)
        mlx_engine.probed.cache_clear()
        reason, registry = mlx_engine.probed()
        assert reason is None and registry is not None and registry.version == "0.0-test"
        assert len(calls) == 1  # no child this time
    finally:
        mlx_engine.probed.cache_clear()
