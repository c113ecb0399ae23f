"""A link cut on a real (virtual) LAN (issue 7): three nodes in network namespaces on one bridge.

Loopback cannot lose a link without losing the process, so here each node has its own namespace and a veth
"cable" to a bridge in a hub namespace; the test pulls one cable for 10 s and plugs it back in. The majority
side must keep one master throughout, and every node must agree again within 10 s of the cable's return.
Everything created (namespaces, veth pairs, the bridge, node processes) is deleted even on failure; host
interfaces are never touched. Skipped when not root.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skulk.master.reconcile import CONNECTION_LOST
from skulk.testing.chaos import Verdicts, Watch, check_converged, check_instance_intact, instance_members, runner_pids
from skulk.testing.convergence import converged, formed, master_of, state_of
from skulk.testing.netns import BridgedLan, NsNode, skip_reason, start_nodes

from .harness import place_and_wait, wait_until

CUT_S = 10.0
CONVERGE_S = 10.0


@pytest.fixture
def lan_nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[BridgedLan, list[NsNode]]]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    lan = BridgedLan(size=3, subnet=random.randint(0, 255))
    nodes: list[NsNode] = []

    def teardown() -> None:
        for node in nodes:
            node.stop()
        leftovers = [pid for node in nodes for pid in node.reap_leftovers()]
        lan.delete()
        assert leftovers == [], "runner processes outlived their node"

    request.addfinalizer(teardown)
    lan.build()
    start_nodes(lan, tmp_path, f"lan{uuid.uuid4().hex[:8]}", nodes)
    yield lan, nodes
    for index, node in enumerate(nodes):  # shown by pytest only when the test failed
        print(f"---- node{index} {node.node_id[:8]} {node.ns} ----\n{node.log_tail(40)}")


@pytest.mark.timeout(180)
def test_cutting_a_link_for_10_s_keeps_one_master_and_converges_after(
    lan_nodes: tuple[BridgedLan, list[NsNode]],
) -> None:
    lan, nodes = lan_nodes
    wait_until(lambda: formed(nodes), 60, "three namespaced nodes to form", lambda: converged(nodes)[1])
    master_id = master_of(nodes[0])
    assert master_id is not None
    cut = max(i for i, n in enumerate(nodes) if n.node_id != master_id)
    majority = [n for i, n in enumerate(nodes) if i != cut]
    serving = next(n for n in majority if n.node_id != master_id)
    instance_id = place_and_wait(serving, excluded_nodes=[n.node_id for n in nodes if n is not serving])
    members = instance_members(state_of(serving) or {}, instance_id)[0]
    pids = runner_pids([serving])
    verdicts = Verdicts()
    with Watch(nodes, poll=0.25) as watch:
        cut_at = time.monotonic()
        lan.cut(cut)
        try:
            time.sleep(CUT_S)
        finally:
            lan.heal(cut)
        check_converged(verdicts, nodes, CONVERGE_S)
    majority_indices = [i for i in range(len(nodes)) if i != cut]
    named = set().union(*(watch.masters_named(i, since=cut_at) for i in majority_indices))
    timeline = {f"node{i}": watch.changes(i, cut_at) for i in range(len(nodes))}
    verdicts.expect(named == {master_id}, f"the majority named {named}, not only {master_id[:8]}: {timeline}")
    verdicts.expect(master_of(nodes[cut]) == master_id, f"node{cut} follows {master_of(nodes[cut])} after healing")
    check_instance_intact(verdicts, nodes, instance_id, members, pids)
    verdicts.settle()


def _backing(node: NsNode, meta_id: str) -> dict[str, dict[str, Any]]:
    bodies = {iid: next(iter(i.values())) for iid, i in ((state_of(node) or {}).get("instances") or {}).items()}
    return {iid: b for iid, b in bodies.items() if b.get("metaInstanceId") == meta_id}


def _chat_ok(node: NsNode) -> bool:
    body = {"model": "skulk/tiny-random-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return node.post("/v1/chat/completions", body, timeout=30)[0] == 200


@pytest.mark.timeout(200)
def test_a_meta_instance_that_loses_a_link_is_placed_again_on_the_nodes_still_linked(
    lan_nodes: tuple[BridgedLan, list[NsNode]],
) -> None:
    """Seed 003's "disconnect Ethernet" scenario: pull the cable of a node of a 2-node MetaInstance; the master
    (on the majority side) re-places it on the two nodes still linked, and a chat through them succeeds."""
    lan, nodes = lan_nodes
    wait_until(lambda: formed(nodes), 60, "three namespaced nodes to form", lambda: converged(nodes)[1])
    master_id = master_of(nodes[0])
    api = next(n for n in nodes if n.node_id == master_id)
    status, reply = api.post("/meta_instance", {"model_id": "skulk/tiny-random-llama", "min_nodes": 2})
    assert status == 200, reply
    meta_id = reply["meta_instance_id"]
    first = wait_until(lambda: next(iter(_backing(api, meta_id)), None), 60, "the MetaInstance placed")
    wait_until(lambda: _chat_ok(api) or None, 90, "a chat through the MetaInstance")
    members = set(_backing(api, meta_id)[first]["shardAssignments"]["nodeToRunner"])
    cut = next(i for i, n in enumerate(nodes) if n.node_id in members and n is not api)
    linked = {n.node_id for i, n in enumerate(nodes) if i != cut}
    lan.cut(cut)
    try:
        second = wait_until(
            lambda: next((i for i, b in _backing(api, meta_id).items()
                          if i != first and set(b["shardAssignments"]["nodeToRunner"]) == linked), None),
            60, "the MetaInstance placed again on the nodes still linked")
        wait_until(lambda: _chat_ok(api) or None, 90, "a chat through the new instance")
    finally:
        lan.heal(cut)
    assert second != first
    # whichever the master saw first: the cut node timing out, or (health per IP edge) the rendezvous edge into
    # rank 0 gone from the topology
    error = (state_of(api) or {})["metaInstances"][meta_id]["lastFailureError"]
    assert "left the cluster" in error or error == CONNECTION_LOST, error
    wait_until(lambda: converged(nodes)[0] or None, CONVERGE_S + 10, "agreement after the cable is back",
               lambda: converged(nodes)[1])
