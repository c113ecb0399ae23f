"""Fixtures that start real node processes on loopback and always clean them up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    assert c.stop_all() == [], "runner processes outlived their node"
