"""Fixtures that start real node processes on loopback and always clean them up.

Every test here carries the `integration` marker (added below, so no module can forget it): `make test-fast`
leaves them out with `-m "not integration"`. Nothing here is rerun: a test that slips under load is a test to
fix (wait on an event or a count, not the wall clock), or one that carries its own `flaky` marker with its
reason written next to it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Cluster

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    assert c.stop_all() == [], "runner processes outlived their node"
