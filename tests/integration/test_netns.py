"""Two nodes in separate network namespaces, joined by a veth pair, find each other by multicast alone.

Loopback tests use explicit endpoints, so they never exercise scouting on a real link. Here each node sees
only its own end of a veth pair (its own "LAN"), has no bootstrap peer, and must discover the other through
zenoh multicast scouting on the interface it was told to use. Everything the test creates (namespaces, the
veth pair, addresses, routes) lives inside namespaces it owns and deletes; host interfaces are never touched.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from skulk.testing.netns import (
    API_PORT,
    ZENOH_PORT,
    NsNode,
    add_namespace,
    delete_namespace,
    ip,
    skip_reason,
    veth_pair,
)


def build_pair(tag: str, subnet: int) -> list[tuple[str, str, str]]:
    """Two namespaces joined by one veth pair (no bridge): each sees only its own end, its own "LAN"."""
    sides = [(f"skulk-{tag}-{s}", f"sk{tag}{s}", f"10.231.{subnet}.{i}") for i, s in ((1, "a"), (2, "b"))]
    for ns, _, _ in sides:
        add_namespace(ns)
    (ns_a, veth_a, _), (ns_b, veth_b, _) = sides
    veth_pair(ns_a, veth_a, ns_b, veth_b)
    for ns, veth, addr in sides:
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        ip("-n", ns, "link", "set", veth, "up", "multicast", "on")
        ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", veth)
    return sides


def delete_namespaces(tag: str) -> None:
    for side in ("a", "b"):
        delete_namespace(f"skulk-{tag}-{side}")


@pytest.fixture
def ns_nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[NsNode]]:
    reason = skip_reason()
    if reason:
        print(f"SKIP test_netns: {reason}")
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    nodes: list[NsNode] = []

    def teardown() -> None:
        for node in nodes:
            node.stop()
        for node in nodes:
            node.reap_leftovers()
        delete_namespaces(tag)

    request.addfinalizer(teardown)
    cluster = f"netns{tag}"
    for ns, veth, addr in build_pair(tag, random.randint(0, 255)):
        node = NsNode(
            home=tmp_path / ns, cluster=cluster, api_port=API_PORT, zenoh_port=ZENOH_PORT,
            ns=ns, veth=veth, addr=addr, multicast=True,
        )  # fmt: skip
        nodes.append(node)
    for node in nodes:
        node.start()
    yield nodes


def formed(nodes: list[NsNode]) -> bool:
    """Each node lists both node ids in nodeMemory, sees both directed links, and all agree on one master."""
    ids = {n.get("/node_id") for n in nodes}
    states = [n.get("/state") for n in nodes]
    if None in ids or len(ids) != 2 or any(s is None for s in states):
        return False
    return (
        all(set(s["nodeMemory"]) == ids for s in states)
        and all(len(s["topology"]["connections"]) == 2 for s in states)
        and len({s["masterNodeId"] for s in states}) == 1
        and states[0]["masterNodeId"] in ids
    )


@pytest.mark.timeout(120)
def test_two_namespaces_discover_each_other_by_multicast(ns_nodes: list[NsNode]) -> None:
    """No bootstrap peers: formation here can only come from multicast scouting over the veth link."""
    deadline = time.monotonic() + 60
    started = time.monotonic()
    while not formed(ns_nodes):
        for node in ns_nodes:
            assert node.alive, f"{node.ns} died:\n{node.log_tail()}"
        if time.monotonic() > deadline:
            detail = "\n".join(f"--- {n.ns}: {n.get('/state')}\n{n.log_tail()}" for n in ns_nodes)
            raise AssertionError(f"the two namespaced nodes did not form one cluster in 60 s\n{detail}")
        time.sleep(0.3)
    print(f"formed over veth by multicast in {time.monotonic() - started:.1f} s")
