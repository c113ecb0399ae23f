"""Real node processes measure their links to each other and their own decode speed, report both in node info
(state's nodeLinks and nodeCompute), and placement previews predict tok/s from them (issue 28)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, place_and_wait, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
MODEL = "skulk/tiny-random-llama"


def state_of(node: LocalNode) -> dict[str, Any]:
    return httpx.get(f"{node.url}/state", timeout=10).json()


def measured_both_ways(nodes: list[LocalNode]) -> bool:
    links = state_of(nodes[0]).get("nodeLinks", {})
    pairs = [(a, b) for a in nodes for b in nodes if a is not b]
    return all((links.get(a.node_id, {}).get(b.node_id) or {}).get("bandwidthMbps") for a, b in pairs)


def test_nodes_report_round_trip_and_bandwidth_to_each_peer(cluster: Cluster) -> None:
    nodes = cluster.form(2)
    wait_until(lambda: measured_both_ways(nodes), 60, "each node to measure its link to the other")
    for a in nodes:
        state = state_of(a)  # every node's state carries every node's measurements
        for source in nodes:
            (peer,) = [n for n in nodes if n is not source]
            link = state["nodeLinks"][source.node_id][peer.node_id]
            assert 0 < link["rttMs"] <= link["probeRttMs"] < 1000
            assert link["bandwidthMbps"] > 0
            assert link["measuredAtS"] > 0
    # the bulk read is a plain admin-gated GET: bounded, and a bad size is the API's typed 422
    reply = httpx.get(f"{nodes[0].url}/node/link_probe", params={"bytes": 10})
    assert reply.status_code == 200 and reply.content == bytes(10)
    too_big = httpx.get(f"{nodes[0].url}/node/link_probe", params={"bytes": 64 * 1024 * 1024})
    assert too_big.status_code == 422 and "error" in too_big.json()


def chat(node: LocalNode, streams: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 24,
            "temperature": 0.0}
    with httpx.Client(base_url=node.url, timeout=120) as client:
        for _ in range(streams):
            client.post("/v1/chat/completions", json=body).raise_for_status()


def previews(node: LocalNode) -> list[dict[str, Any]]:
    reply = httpx.get(f"{node.url}/instance/previews", params={"model_id": MODEL}, timeout=30)
    reply.raise_for_status()
    return [p for p in reply.json()["previews"] if p["error"] is None]


def test_previews_predict_decode_speed_once_a_node_has_served(cluster: Cluster) -> None:
    nodes = cluster.form(2)
    assert all(p["predicted_decode_tps"] is None for p in previews(nodes[0]))  # nothing served: nothing known
    place_and_wait(nodes[0], MODEL, excluded_nodes=[nodes[1].node_id])

    def learned() -> bool:
        chat(nodes[0], 2)
        compute = state_of(nodes[0]).get("nodeCompute", {})
        return any("1" in c["stepSPerGb"] for c in compute.values())

    wait_until(learned, 120, "the serving node to learn its decode speed")
    wait_until(lambda: measured_both_ways(nodes), 60, "the links to be measured")
    found = previews(nodes[0])
    assert {len(p["memory_delta_by_node"]) for p in found} == {1, 2}
    for preview in found:
        assert preview["predicted_decode_tps"] > 0, preview
        assert preview["predicted_batch"] == 8
    one = max(p["predicted_decode_tps"] for p in found if len(p["memory_delta_by_node"]) == 1)
    for split in (p for p in found if len(p["memory_delta_by_node"]) == 2):
        # same machine, same figure: a split adds hops and never beats one node, and says so
        assert split["predicted_decode_tps"] < one
        assert split["predicted_warning"] and "slower than fewer nodes" in split["predicted_warning"]


def test_a_fresh_cluster_predicts_before_anything_was_served(cluster: Cluster) -> None:
    """With the start-up calibration on (issue 41), each node reports its compute within seconds of starting and
    the links are measured on join: the previews of a cluster that never served already predict."""
    nodes = cluster.form(2, extra_env={"SKULK_CALIBRATE_COMPUTE": "1"})

    def calibrated() -> bool:
        compute = state_of(nodes[0]).get("nodeCompute", {})
        return all((compute.get(n.node_id) or {}).get("calibrated") for n in nodes)

    wait_until(calibrated, 90, "both nodes' calibrated compute in state", lambda: str(state_of(nodes[0])
                                                                                        .get("nodeCompute")))
    wait_until(lambda: measured_both_ways(nodes), 60, "the links to be measured")
    found = previews(nodes[0])
    assert found and all(p["predicted_decode_tps"] and p["predicted_aggregate_tps"] for p in found), found
    assert state_of(nodes[0]).get("tasks", {}) == {}, "nothing was served"
    # the same child measured a runner's runtime overhead: the first previews count it, not the default ceiling
    memory = state_of(nodes[0]).get("nodeMemory", {})
    for node in nodes:
        (overhead,) = memory[node.node_id]["runnerOverheads"]
        assert (overhead["engine"], overhead["role"]) == ("torch", "first"), overhead
        assert 100 * 2**20 < overhead["overhead"]["inBytes"] < 2**30, overhead
    assert all(all(p["runtime_measured_by_node"].values()) for p in found), found
