"""The peers this node has known, where to reach them, and which left recently (node-local, never gossiped).

Diagnostics keep listing a peer that left (ok: false, since when) at the address it last had: the master's
NodeTimedOut may remove it from state before this node's own lease on it runs out."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from skulk.diagnostics.cluster import DepartedPeer, local_addresses, peer_url
from skulk.types.events import Event, NodeGatheredInfo, NodeTimedOut
from skulk.types.ids import NodeId
from skulk.types.state import State

DEPARTED_KEPT = timedelta(minutes=10)


class PeerBook:
    def __init__(self, node_id: NodeId) -> None:
        self._node_id = node_id
        self._departed: dict[NodeId, DepartedPeer] = {}
        self._urls: dict[NodeId, str | None] = {}

    def departed(self) -> Mapping[NodeId, DepartedPeer]:
        """Peers that left within DEPARTED_KEPT."""
        cutoff = datetime.now(UTC) - DEPARTED_KEPT
        return {n: d for n, d in self._departed.items() if d.left_at > cutoff}

    def membership_changed(self, node: NodeId, alive: bool) -> None:
        if alive:
            self._departed.pop(node, None)
        else:
            self._depart(node)

    def remember(self, state: State, event: Event | None) -> None:
        """Where each peer is, from a snapshot (event None: every peer it knows) or one event."""
        if event is None:
            ours = local_addresses()
            for node in state.node_api_ports:
                if node != self._node_id:
                    self._urls[node] = peer_url(state, self._node_id, node, ours)
        elif isinstance(event, NodeGatheredInfo) and event.node_id != self._node_id:
            url = peer_url(state, self._node_id, event.node_id, local_addresses())
            self._urls[event.node_id] = url
            self._restarted_at(url, event.node_id)
        elif isinstance(event, NodeTimedOut):
            self._depart(event.node_id)

    def _restarted_at(self, url: str | None, node: NodeId) -> None:
        """A node now answering at a departed peer's address is that peer restarted (a restart takes a new
        node id): the old id is no longer listed as unreachable (`skulk diag`)."""
        if url is None:
            return
        for old in [n for n, d in self._departed.items() if d.url == url and n != node]:
            del self._departed[old]

    def _depart(self, node: NodeId) -> None:
        if node in self._urls and node not in self._departed:
            self._departed[node] = DepartedPeer(url=self._urls[node], left_at=datetime.now(UTC))
