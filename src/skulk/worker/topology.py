"""Which peers this node can reach, and at which address: the edges placement builds rings from.

The decision (what to probe, which edge events follow from the answers) is pure; the probing is a thin
httpx shell that asks each candidate address for the peer's node id on a signed call (`internal_auth`), so a
reused address, or a keyless host answering in the peer's name, is never mistaken for the peer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import httpx

from skulk import internal_auth, peer_tls
from skulk.types.events import Event, TopologyEdgeCreated, TopologyEdgeDeleted
from skulk.types.ids import NodeId
from skulk.types.node_info import Connection
from skulk.types.state import State
from skulk.worker.links import LinkMeter

PROBE_TIMEOUT_S = 1.0
EDGE_MISSES = 3
"""Consecutive failed probes (one a second) before this node withdraws its edge to a peer. One slow answer on a
busy machine (a probe waits PROBE_TIMEOUT_S) withdrew the edge at once, and a withdrawn edge deletes every bound
instance across it ("Network connection lost"); a cut cable still shows within a few seconds. A node that is gone
is seen sooner anyway, by its liveliness token."""


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


def debounced(
    state: State, me: NodeId, reachable: dict[NodeId, Connection | str], misses: dict[NodeId, int]
) -> tuple[dict[NodeId, Connection | None], dict[NodeId, int]]:
    """Pure: the probe's answers as edge_events should take them, and the misses counted so far. A peer this node
    has an edge to keeps it until EDGE_MISSES probes in a row failed (a str: why the last one did); a peer without
    one gets it at its first answer."""
    ours = {c.sink: c for c in state.topology.connections if c.source == me}
    taken: dict[NodeId, Connection | None] = {}
    counted: dict[NodeId, int] = {}
    for node, found in reachable.items():
        held = ours.get(node)
        if isinstance(found, str) and held is not None and (missed := misses.get(node, 0) + 1) < EDGE_MISSES:
            taken[node], counted[node] = held, missed
        else:
            taken[node] = found if isinstance(found, Connection) else None
    return taken, counted


async def _reaches(client: httpx.AsyncClient, address: str, port: int, node: NodeId) -> float | str:
    """Seconds the peer took to name itself at this address (the round-trip sample), or why it did not."""
    try:
        started = time.perf_counter()
        reply = await client.get(f"{peer_tls.base_url(address, port)}/node/probe", timeout=PROBE_TIMEOUT_S,
                                 auth=internal_auth.signer(node))
        elapsed = time.perf_counter() - started
        if reply.status_code != 200:
            return f"{address}: HTTP {reply.status_code}"
        if reply.json() != node or not internal_auth.answered_by(reply, node):
            return f"{address}: answered by another node"
        return elapsed
    except (httpx.HTTPError, ValueError) as exc:
        return f"{address}: {type(exc).__name__}"


async def _first_reachable(
    client: httpx.AsyncClient, me: NodeId, node: NodeId, port: int, candidates: Iterable[tuple[str, str | None]],
    meter: LinkMeter | None,
) -> Connection | str:
    why: list[str] = []
    for address, interface in candidates:
        rtt = await _reaches(client, address, port, node)
        if isinstance(rtt, str):
            why.append(rtt)
            continue
        if meter is not None:
            meter.add_rtt(node, rtt)
        return Connection(source=me, sink=node, sink_address=address, interface=interface)
    return "; ".join(why) or "no address"


async def probe(
    client: httpx.AsyncClient, state: State, me: NodeId, meter: LinkMeter | None = None
) -> dict[NodeId, Connection | str]:
    """Which peers answer, and at which address (else why not); each answer's time is a round-trip sample for
    `meter`."""
    targets = probe_targets(state, me)
    found = await asyncio.gather(
        *(_first_reachable(client, me, node, state.node_api_ports[node], addrs, meter)
          for node, addrs in targets.items())
    )
    return dict(zip(targets, found, strict=True))
