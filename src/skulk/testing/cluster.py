"""A cluster of real node processes on loopback, started and always stopped by one test or benchmark.

Shared by the integration tests (through tests/integration/harness.py) and the benchmarks, so both start,
place on and tear down clusters the same way.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from .chaos import instance_members
from .convergence import formed, master_of, why_not_formed
from .nodes import LocalNode
from .waiting import wait_until

DEMO = "skulk/tiny-random-llama"


class Cluster:
    """Nodes started by one test or module, all stopped and checked for orphans at the end."""

    def __init__(self, root: Path, prefix: str = "t", extra_env: dict[str, str] | None = None) -> None:
        self.root = root
        self.name = f"{prefix}{uuid.uuid4().hex[:10]}"
        self.extra_env = extra_env or {}
        self.nodes: list[LocalNode] = []

    def start(self, count: int = 1, **options: Any) -> list[LocalNode]:
        started = []
        for _ in range(count):
            peers = [n.endpoint for n in self.nodes]
            home = self.root / f"node{len(self.nodes)}"
            settings = {"extra_env": dict(self.extra_env), **options}
            node = LocalNode(home=home, cluster=self.name, peers=peers, **settings)
            self.nodes.append(node.start())
            started.append(node)
        for node in started:
            node.wait_ready()
        return started

    def form(self, count: int = 3, timeout: float = 60.0, **options: Any) -> list[LocalNode]:
        """Start `count` nodes (each bootstraps to the earlier ones) and wait until they form one cluster."""
        nodes = self.start(count, **options)
        wait_until(lambda: formed(nodes), timeout, f"{count} nodes to form one cluster",
                   lambda: why_not_formed(nodes) + "".join(f"\n---- node{i} log ----\n{n.log_tail(15)}"
                                                           for i, n in enumerate(nodes)))
        return nodes

    def master(self, nodes: list[LocalNode]) -> LocalNode:
        """The node the first of `nodes` names master (they are formed, so all name the same one)."""
        master_id = master_of(nodes[0])
        return next(n for n in nodes if n.node_id == master_id)

    def print_logs(self, lines: int = 40) -> None:
        """Each node's last output lines, for the report of a failed test (pytest shows captured stdout)."""
        for index, node in enumerate(self.nodes):
            print(f"---- node{index} {node.node_id[:8]} ----\n{node.log_tail(lines)}")

    def stop_all(self) -> list[int]:
        for node in self.nodes:
            node.stop()
        leftovers: list[int] = []
        for node in self.nodes:
            leftovers += node.reap_leftovers()
        return leftovers


def place(node: LocalNode, model_id: str = DEMO, **body: Any) -> dict[str, Any]:
    status, reply = node.post("/place_instance", {"model_id": model_id, **body})
    assert status == 200, f"placement refused ({status}): {reply}"
    return reply


def instance_ready(node: LocalNode, instance_id: str) -> bool:
    """Every runner of the instance is Ready or Running, as `node` sees it (False while it cannot answer)."""
    state = node.get("/state", timeout=10)
    _, runners = instance_members(state or {}, instance_id)
    return bool(runners) and all(
        "RunnerReady" in state["runners"].get(r, {}) or "RunnerRunning" in state["runners"].get(r, {}) for r in runners
    )


def place_and_wait(node: LocalNode, model_id: str = DEMO, **body: Any) -> str:
    instance_id = place(node, model_id, **body)["instanceId"]
    wait_until(lambda: instance_ready(node, instance_id), 90, f"instance {instance_id} to be ready")
    return instance_id
