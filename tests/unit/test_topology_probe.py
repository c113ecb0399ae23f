"""Which edges a node's probe answers create and withdraw (worker/topology.py, pure): a held edge survives
EDGE_MISSES - 1 failed probes in a row, a new one is created at the first answer."""

from __future__ import annotations

from skulk.types.events import TopologyEdgeCreated, TopologyEdgeDeleted
from skulk.types.ids import NodeId
from skulk.types.node_info import Connection, Topology
from skulk.types.state import State
from skulk.worker.topology import EDGE_MISSES, debounced, edge_events

ME, PEER, OTHER = NodeId("me"), NodeId("peer"), NodeId("other")
EDGE = Connection(source=ME, sink=PEER, sink_address="127.0.0.1")


def with_edge() -> State:
    return State(topology=Topology(nodes=[ME, PEER, OTHER], connections=[EDGE]))


def test_a_held_edge_is_withdrawn_only_after_enough_misses_in_a_row() -> None:
    state, misses = with_edge(), {}
    for attempt in range(1, EDGE_MISSES):
        taken, misses = debounced(state, ME, {PEER: "127.0.0.1: ReadTimeout"}, misses)
        assert taken == {PEER: EDGE} and misses == {PEER: attempt}
        assert edge_events(state, ME, taken) == []
    taken, misses = debounced(state, ME, {PEER: "127.0.0.1: ReadTimeout"}, misses)
    assert taken == {PEER: None} and misses == {}
    assert edge_events(state, ME, taken) == [TopologyEdgeDeleted(connection=EDGE)]


def test_an_answer_resets_the_count() -> None:
    state = with_edge()
    taken, misses = debounced(state, ME, {PEER: "timeout"}, {PEER: EDGE_MISSES - 2})
    assert misses == {PEER: EDGE_MISSES - 1} and taken == {PEER: EDGE}
    taken, misses = debounced(state, ME, {PEER: EDGE}, misses)
    assert misses == {} and taken == {PEER: EDGE}
    _, misses = debounced(state, ME, {PEER: "timeout"}, misses)
    assert misses == {PEER: 1}, "a new run of misses starts from one"


def test_a_peer_without_an_edge_gets_one_at_its_first_answer_and_none_while_silent() -> None:
    state = with_edge()
    new = Connection(source=ME, sink=OTHER, sink_address="10.0.0.3", interface="eth0")
    taken, misses = debounced(state, ME, {OTHER: "10.0.0.3: ConnectError"}, {})
    assert taken == {OTHER: None} and misses == {} and edge_events(state, ME, taken) == []
    taken, _ = debounced(state, ME, {OTHER: new}, misses)
    assert edge_events(state, ME, taken) == [TopologyEdgeCreated(connection=new)]
