"""Fan-out: peer URLs; a dead peer is ok:false within the per-peer timeout (real socket, real httpx)."""

from __future__ import annotations

import asyncio
import socket
import time

from skulk.diagnostics.cluster import collect_cluster, fetch_peers, known_peers, peer_url
from skulk.diagnostics.node_bundle import build_node_bundle
from skulk.types.ids import NodeId
from skulk.types.node_info import Connection, NetworkInfo, NetworkInterface, Topology
from skulk.types.state import State

from .diagnostics_fakes import NOW, FakeNode, cluster_state

N1, N2 = NodeId("n1"), NodeId("n2")


def _closed_port() -> int:
    """A port nothing listens on: bind, read the number, close."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_peer_state(port: int) -> State:
    """n2 shares our address, so it is reached on loopback at its API port."""
    state = cluster_state()
    net = {
        **state.node_network,
        N2: NetworkInfo(interfaces=[NetworkInterface(name="e", ip_address="10.9.9.9")]),
    }
    return state.model_copy(update={"node_network": net, "node_api_ports": {N1: 1, N2: port}})


def test_peer_on_this_machine_is_reached_on_loopback() -> None:
    state = _local_peer_state(5555)
    assert peer_url(state, N1, N2, {"10.9.9.9"}) == "http://127.0.0.1:5555"


def test_peer_url_prefers_the_topology_edge_then_a_shared_subnet() -> None:
    state = cluster_state()
    edge = Connection(source=N1, sink=N2, sink_address="tcp/192.168.7.2:7447")
    with_edge = state.model_copy(update={"topology": Topology(nodes=[N1, N2], connections=[edge])})
    assert peer_url(with_edge, N1, N2, {"10.0.0.1"}) == "http://192.168.7.2:52415"
    assert peer_url(state, N1, N2, {"10.0.0.1"}) == "http://10.0.0.2:52415"
    no_port = state.model_copy(update={"node_api_ports": {}})
    assert peer_url(no_port, N1, N2, set()) is None


def test_known_peers_include_placement_nodes_that_stopped_reporting() -> None:
    state = cluster_state(("n1", "n2", "n3"))
    forgotten = state.model_copy(
        update={"node_api_ports": {}, "last_seen": {}, "node_network": {}, "topology": Topology()}
    )
    assert known_peers(forgotten, N1) == ["n2", "n3"]


def test_closed_port_peer_is_ok_false_within_the_timeout() -> None:
    port = _closed_port()
    state = _local_peer_state(port)
    started = time.monotonic()
    (result,) = asyncio.run(fetch_peers(state, N1, [N2], timeout=1.0, ours={"10.9.9.9"}))
    elapsed = time.monotonic() - started
    assert result.ok is False and result.url == f"http://127.0.0.1:{port}"
    assert result.error and result.diagnostics is None
    assert elapsed < 1.5


def test_a_listening_but_silent_peer_times_out_and_others_still_answer() -> None:
    """A wedged peer accepts the connection and never answers: bounded by one timeout, not more."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        state = _local_peer_state(silent.getsockname()[1])
        node = FakeNode(N1, state, N1)
        local = build_node_bundle(node, NOW)
        started = time.monotonic()
        bundle = asyncio.run(collect_cluster(local, state, N1, N1, timeout=0.5, ours={"10.9.9.9"}))
        elapsed = time.monotonic() - started
    by_node = {n.node_id: n for n in bundle.nodes}
    assert by_node["n1"].ok is True and by_node["n2"].ok is False
    assert "timed out" in (by_node["n2"].error or "")
    assert 0.4 < elapsed < 1.5
