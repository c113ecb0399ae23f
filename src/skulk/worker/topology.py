"""Which peers this node can reach, and at which address: the edges placement builds rings from.

The decision (what to probe, which edge events follow from the answers) is pure; the probing is a thin
httpx shell that asks each candidate address for the peer's node id, so a reused address is never mistaken
for the peer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx

from skulk.types.events import Event, TopologyEdgeCreated, TopologyEdgeDeleted
from skulk.types.ids import NodeId
from skulk.types.node_info import Connection
from skulk.types.state import State

PROBE_TIMEOUT_S = 1.0


def probe_targets(state: State, me: NodeId) -> dict[NodeId, list[tuple[str, str | None]]]:
    """Every other node with a known API port, and its candidate (address, interface) pairs, loopback first."""
    targets: dict[NodeId, list[tuple[str, str | None]]] = {}
    for node in state.topology.nodes:
        if node == me or node not in state.node_api_ports:
            continue
        interfaces = state.node_network.get(node)
        addresses: list[tuple[str, str | None]] = (
            [(i.ip_address, i.name) for i in interfaces.interfaces] if interfaces else []
        )
        addresses.sort(key=lambda a: not a[0].startswith("127."))
        targets[node] = addresses or [("127.0.0.1", None)]
    return targets


def edge_events(state: State, me: NodeId, reachable: dict[NodeId, Connection | None]) -> list[Event]:
    """Create edges that are newly reachable, delete ours that are no longer (or changed address)."""
    ours = {c.sink: c for c in state.topology.connections if c.source == me}
    events: list[Event] = []
    for node, found in reachable.items():
        current = ours.get(node)
        if found == current:
            continue
        if current is not None:
            events.append(TopologyEdgeDeleted(connection=current))
        if found is not None:
            events.append(TopologyEdgeCreated(connection=found))
    return events


async def _reaches(client: httpx.AsyncClient, address: str, port: int, node: NodeId) -> bool:
    try:
        reply = await client.get(f"http://{address}:{port}/node_id", timeout=PROBE_TIMEOUT_S)
        return reply.status_code == 200 and reply.json() == node
    except (httpx.HTTPError, ValueError):
        return False


async def _first_reachable(
    client: httpx.AsyncClient, me: NodeId, node: NodeId, port: int, candidates: Iterable[tuple[str, str | None]]
) -> Connection | None:
    for address, interface in candidates:
        if await _reaches(client, address, port, node):
            return Connection(source=me, sink=node, sink_address=address, interface=interface)
    return None


async def probe(client: httpx.AsyncClient, state: State, me: NodeId) -> dict[NodeId, Connection | None]:
    targets = probe_targets(state, me)
    found = await asyncio.gather(
        *(_first_reachable(client, me, node, state.node_api_ports[node], addrs) for node, addrs in targets.items())
    )
    return dict(zip(targets, found, strict=True))
