"""Hostile GGUF files through a real node's POST /models/import (issue 38): each costs one typed 400, quickly, and
the node keeps answering and keeps its place in the cluster while it is refused (before: 500s, and a 50 MB
metadata string froze the node's event loop for seconds at a time until the master dropped it)."""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from skulk.testing.nodes import LocalNode
from tests.unit.hostile_files import gguf_bytes, gguf_kv_string, gguf_string, write

from .harness import Cluster, wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalNode]]:
    cluster = Cluster(tmp_path_factory.mktemp("hostile"))
    try:
        yield cluster.form(2)
    finally:
        assert cluster.stop_all() == [], "processes outlived their node"


def hostile_files(folder: Path) -> dict[str, Path]:
    good = gguf_bytes()
    return {
        "truncated": write(folder / "truncated.gguf", good[:len(good) // 2]),
        "2^63 tensors": write(folder / "count.gguf", gguf_bytes(tensor_count=2**63)),
        "2^62 string": write(folder / "string.gguf", gguf_bytes(
            [gguf_string("general.name") + struct.pack("<IQ", 8, 2**62) + b"x" * 64])),
        "50 MB string": write(folder / "big.gguf", gguf_bytes(
            [gguf_kv_string("general.architecture", "llama"), gguf_kv_string("general.name", b"x" * (50 << 20))])),
        "not gguf": write(folder / "noise.gguf", os.urandom(4096)),
    }


class HealthProbe(threading.Thread):
    """Times GET /healthz on a node, back to back, until stopped: the slowest answer shows a frozen loop."""

    def __init__(self, node: LocalNode) -> None:
        super().__init__(daemon=True)
        self.node, self.done, self.slowest, self.answers = node, threading.Event(), 0.0, 0

    def run(self) -> None:
        with httpx.Client(base_url=self.node.url, timeout=10, trust_env=False) as client:
            while not self.done.is_set():
                start = time.monotonic()
                assert client.get("/healthz").status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - start)
                self.answers += 1
                self.done.wait(0.05)


def test_hostile_gguf_imports_are_typed_400s_and_the_node_stays(nodes: list[LocalNode], tmp_path: Path) -> None:
    target, other = nodes[1], nodes[0]
    probe = HealthProbe(target)
    probe.start()
    answers: dict[str, tuple[int, object, float]] = {}
    try:
        for case, path in hostile_files(tmp_path).items():
            start = time.monotonic()
            status, body = target.post("/models/import", {"source": str(path)}, timeout=60)
            answers[case] = (status, body, time.monotonic() - start)
    finally:
        probe.done.set()
        probe.join(15)
    for case, (status, body, elapsed) in answers.items():
        assert status == 400, f"{case}: {status} {body}"
        assert isinstance(body, dict) and body["error"]["code"] == "invalid_model_file", f"{case}: {body}"
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"], f"{case}: {body}"
        assert elapsed < 20, f"{case} took {elapsed:.1f} s"
    assert "more than the 1048576 allowed" in answers["50 MB string"][1]["error"]["message"]  # type: ignore[index]
    assert probe.answers > 0 and probe.slowest < 1.0, f"/healthz took up to {probe.slowest:.2f} s during imports"
    wait_until(lambda: _sees(other, target.node_id), 10, "the other node to list the target in /state")


def _sees(observer: LocalNode, node_id: str) -> bool:
    state = observer.get("/state")
    return isinstance(state, dict) and node_id in state.get("nodeMemory", {})
