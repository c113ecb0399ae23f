"""Fixtures that start real node processes on loopback and always clean them up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Cluster

RERUNS = 1
"""Integration tests run real node processes on a shared 2-core machine, where a timing can slip now and then;
each may run once more, with fresh nodes. A test that fails twice fails, and pytest's summary lists every rerun
(`R`), so a flaky test stays visible instead of being hidden."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in str(item.path) and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=RERUNS))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    assert c.stop_all() == [], "runner processes outlived their node"
