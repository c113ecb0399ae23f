"""A full-cluster restart keeps what an operator created (issue 27): SIGTERM every node of a three-node cluster,
start them again on the same homes, and the MetaInstance comes back and serves within 60 s."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from skulk.testing.nodes import LocalNode
from skulk.testing.streams import StreamProbe, chat_body

from .harness import Cluster, place_and_wait, wait_until

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


def test_a_stream_open_at_sigterm_ends_with_a_retryable_error(cluster: Cluster) -> None:
    """The runner stalls in decode (SKULK_FAULT), so the stream is open when the node gets SIGTERM: it must end
    retryably (before: uvicorn's graceful shutdown cancelled it at 2 s into a 500 Internal Server Error)."""
    node = cluster.form(1, extra_env={"SKULK_FAULT": "stall:decode_stream"})[0]  # formed: its memory is known
    place_and_wait(node)
    probe = StreamProbe(node.url, chat_body(MODEL, 64, temperature=0.0), read_timeout=120)

    def open_task() -> bool:
        tasks = (node.get("/state", timeout=10) or {}).get("tasks", {})
        return any(next(iter(t.values())).get("taskStatus") in ("Pending", "Running") for t in tasks.values())

    wait_until(open_task, 60, "the request to reach its runner (which stalls in decode)")
    time.sleep(1.0)  # into the stall: the runner has taken it (nothing to wait on: a stalled runner says nothing)
    assert probe.outcome.ended is None
    node.stop()
    ended = probe.wait(30)
    assert ended.retryable_error, ended.describe()  # an error event, or a 503 before the stream's first byte
    assert ended.error is not None and ended.error.get("code") == "node_shutting_down", ended.error
