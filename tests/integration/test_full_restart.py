"""A full-cluster restart keeps what an operator created (issue 27): SIGTERM every node of a three-node cluster,
start them again on the same homes, and the MetaInstance comes back and serves within 60 s."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, wait_until

MODEL = "skulk/tiny-random-llama"
SERVING_AGAIN_S = 60.0
pytestmark = pytest.mark.timeout(300)


def chat_ok(node: LocalNode) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        return httpx.post(node.url + "/v1/chat/completions", json=body, timeout=20).status_code == 200
    except httpx.HTTPError:
        return False


def metas(node: LocalNode) -> dict[str, dict[str, object]]:
    state = node.get("/state", timeout=10)
    return state["metaInstances"] if state else {}


def stop_together(nodes: list[LocalNode]) -> None:
    """SIGTERM to every node at once, as a power cut's orderly cousin (a UPS telling every host to shut down)."""
    threads = [threading.Thread(target=n.stop) for n in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_a_meta_instance_serves_again_after_every_node_restarts(cluster: Cluster) -> None:
    nodes = cluster.form(3)
    reply = httpx.post(nodes[1].url + "/meta_instance", json={"model_id": MODEL}, timeout=30)
    assert reply.status_code == 200, reply.text
    meta_id = reply.json()["meta_instance_id"]
    wait_until(lambda: chat_ok(nodes[0]), 90, "the MetaInstance to serve before the restart")
    old_ids = {n.node_id for n in nodes}

    stop_together(nodes)
    assert all(not n.alive for n in nodes)
    restarted_at = time.monotonic()
    for node in nodes:
        node.restart()
    for node in nodes:
        node.wait_ready()
    assert not old_ids & {n.node_id for n in nodes}, "node ids are per session: nothing placed can be reused"
    wait_until(lambda: chat_ok(nodes[2]), SERVING_AGAIN_S, "the MetaInstance to serve again after the restart",
               lambda: cluster.print_logs(20) or "")
    took = time.monotonic() - restarted_at
    assert took < SERVING_AGAIN_S
    assert list(metas(nodes[0])) == [meta_id], "the same MetaInstance, restored once"
    print(f"full restart -> serving again: {took:.1f} s")
