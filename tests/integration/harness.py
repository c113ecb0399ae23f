"""Helpers for integration tests: clusters of real node processes, and waiting on what they report.

They live in skulk.testing so benchmarks share them; this module keeps the tests' import path, and adds what only
tests need (the stand-in hub of tests/fake_hub.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from skulk.testing.cluster import Cluster, instance_ready, place, place_and_wait
from skulk.testing.nodes import LocalNode
from skulk.testing.waiting import wait_until
from tests.fake_hub import RunningHub

__all__ = ["Cluster", "hub_and_nodes", "instance_ready", "place", "place_and_wait", "wait_until"]

T = TypeVar("T")


@contextmanager
def hub_and_nodes(root: Path, count: int, write: Callable[[Path, Path], T],
                  env: dict[str, str] | None = None) -> Iterator[tuple[list[LocalNode], T]]:
    """A stand-in hub and `count` formed nodes that download from it, and what `write(hub, scratch)` returned:
    the checkpoints are written while the nodes start (their imports take the other core), since the hub serves
    what its directory holds when asked and nothing is asked before a test adds a model. The nodes' logs are
    printed if the setup or a test fails; every node and runner is stopped at the end."""
    (root / "hub").mkdir()
    hub = RunningHub(root / "hub").start()
    cluster = Cluster(root / "nodes", extra_env={"HF_ENDPOINT": hub.url, **(env or {})})
    try:
        with ThreadPoolExecutor(1) as pool:
            forming = pool.submit(cluster.form, count, 120, place_default=False)
            written = write(root / "hub", root / "scratch")
            nodes = forming.result()
        yield nodes, written
    except BaseException:
        cluster.print_logs()
        raise
    finally:
        hub.kill()
        assert cluster.stop_all() == [], "runner processes outlived their node"
