"""`skulk diag` stops listing a restarted node's old id as unreachable: a node answering at a departed peer's
address is that peer under its new id."""

from __future__ import annotations

from skulk.diagnostics.peers import PeerBook
from skulk.types.events import NodeGatheredInfo, NodeTimedOut
from skulk.types.ids import NodeId
from skulk.types.node_info import Connection, NodeInfo, Topology
from skulk.types.state import State

ME, OLD, NEW, OTHER = NodeId("me"), NodeId("old"), NodeId("new"), NodeId("other")


def state_with(*peers: tuple[NodeId, str, int]) -> State:
    return State(
        topology=Topology(nodes=[ME, *(p for p, _, _ in peers)],
                          connections=[Connection(source=ME, sink=p, sink_address=a) for p, a, _ in peers]),
        node_api_ports={p: port for p, _, port in peers},
    )


def gathered(node: NodeId) -> NodeGatheredInfo:
    return NodeGatheredInfo(node_id=node, info=NodeInfo(), when="2026-11-26T00:00:00Z")  # type: ignore[arg-type]


def test_a_restarted_node_replaces_its_old_id_in_the_departed_list() -> None:
    book = PeerBook(ME)
    before = state_with((OLD, "10.0.0.2", 52415), (OTHER, "10.0.0.3", 52415))
    book.remember(before, gathered(OLD))
    book.remember(before, gathered(OTHER))
    book.remember(before, NodeTimedOut(node_id=OLD))
    book.remember(before, NodeTimedOut(node_id=OTHER))
    assert set(book.departed()) == {OLD, OTHER}
    after = state_with((NEW, "10.0.0.2", 52415))
    book.remember(after, gathered(NEW))  # the same machine and port, a new node id
    assert set(book.departed()) == {OTHER}, "the old id is the restarted node, not an unreachable one"


def test_another_port_on_the_same_host_is_another_node() -> None:
    book = PeerBook(ME)
    before = state_with((OLD, "10.0.0.2", 52415))
    book.remember(before, gathered(OLD))
    book.remember(before, NodeTimedOut(node_id=OLD))
    book.remember(state_with((NEW, "10.0.0.2", 52416)), gathered(NEW))
    assert set(book.departed()) == {OLD}
