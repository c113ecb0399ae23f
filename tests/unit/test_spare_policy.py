"""When a node keeps no spare runner (worker/spare.py): switched off, in its first seconds, short of memory; and
which engine a spare imports. The spare's process itself is tested over a real node (test_spare_runner.py)."""

from __future__ import annotations

import logging

import pytest

from skulk.worker import spare as spare_module
from skulk.worker.spare import SpareRunner, spare_engine


def spawned(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each spawn the pool would make, recorded instead of started."""
    calls: list[str] = []

    class Recorder:
        def __init__(self, **kwargs: object) -> None:
            calls.append(str(kwargs.get("name")))

        def start(self) -> None: ...

        def is_alive(self) -> bool:
            return True

    monkeypatch.setattr(spare_module.mp.get_context("spawn"), "Process", Recorder)
    return calls


def test_no_spare_while_off_or_in_the_first_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spawned(monkeypatch)
    SpareRunner("torch", enabled=False, after_s=0).fill()
    SpareRunner("torch", after_s=3600).fill()
    assert calls == []
    pool = SpareRunner("torch", after_s=0, min_available=0)
    pool.fill()
    pool.fill()  # one spare at most
    assert calls == ["skulk-runner-spare"]


def test_no_spare_short_of_memory_said_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    calls = spawned(monkeypatch)
    monkeypatch.setattr(spare_module.memory_limit, "available_now", lambda: 3 * 1024**3)
    pool = SpareRunner("torch", after_s=0)
    with caplog.at_level(logging.INFO, logger="skulk.worker"):
        pool.fill()
        pool.fill()
    assert calls == []
    assert [r.getMessage() for r in caplog.records].count("no spare runner: less than 4096 MiB available") == 1


def test_a_spare_is_taken_once_and_only_for_its_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    spawned(monkeypatch)
    pool = SpareRunner("torch", after_s=0, min_available=0)
    pool.fill()
    assert pool.take("mlx") is None
    assert pool.take("torch") is not None
    assert pool.take("torch") is None


def test_the_spare_imports_the_engine_the_node_offers_first() -> None:
    assert spare_engine(["mlx", "torch"], "linux") == "mlx"
    assert spare_engine([], "linux") == "torch"
    assert spare_engine([], "darwin") == "mlx"


def test_a_bad_delay_setting_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(spare_module.SPARE_AFTER_ENV, "soon")
    pool = SpareRunner("torch")
    assert pool.not_before > spare_module.time.monotonic() + spare_module.SPARE_AFTER_START_S - 5


def test_a_ready_runner_holds_the_next_spare_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spawned(monkeypatch)
    now = [1000.0]
    monkeypatch.setattr(spare_module.time, "monotonic", lambda: now[0])
    pool = SpareRunner("torch", after_s=20, min_available=0)
    now[0] += 25
    pool.hold_off()  # a runner became ready: its first requests come before the spare's imports
    now[0] += 10
    pool.fill()
    assert calls == []
    now[0] += 11
    pool.fill()
    assert calls == ["skulk-runner-spare"]
