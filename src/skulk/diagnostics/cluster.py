"""Cluster fan-out: ask every peer for its node bundle in parallel, each under its own timeout.

A dead or wedged peer must never turn the whole response into an error or make it wait longer than one
per-peer timeout: it becomes `{ok: false, error}` and the others are reported as usual.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import httpx
import psutil
from pydantic import ValidationError

from skulk import internal_auth, peer_tls
from skulk.diagnostics.clock import iso, utc_now
from skulk.types.diagnostics_bundle import ClusterDiagnostics, ClusterNodeDiagnostics, NodeDiagnostics
from skulk.types.ids import NodeId
from skulk.types.state import State

DEFAULT_PEER_TIMEOUT_S = 3.0
NODE_PATH = "/v1/diagnostics/node"
LOOPBACK = "127.0.0.1"


def local_addresses() -> set[str]:
    return {addr.address for addrs in psutil.net_if_addrs().values() for addr in addrs if addr.family == socket.AF_INET}


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _host_of(endpoint: str) -> str:
    """`10.0.0.2`, `tcp/10.0.0.2:7447` or `10.0.0.2:7447` → `10.0.0.2`."""
    host = endpoint.split("/", 1)[-1]
    if host.startswith("["):
        return host[1 : host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _same_subnet(a: str, b: str) -> bool:
    """Without netmasks in the gossip, a shared /24 is the best guess at a directly reachable peer."""
    try:
        return ipaddress.ip_network(f"{a}/24", strict=False) == ipaddress.ip_network(f"{b}/24", strict=False)
    except ValueError:
        return False


def peer_address(state: State, local: NodeId, peer: NodeId, ours: set[str]) -> str | None:
    """Prefer loopback for a peer on this machine, then the address our topology edge reached it at."""
    network = state.node_network.get(peer)
    theirs = [i.ip_address for i in network.interfaces] if network else []
    routable = [a for a in theirs if not _is_loopback(a)]
    if any(a in ours for a in routable):
        return LOOPBACK
    edge = next((c for c in state.topology.connections if c.source == local and c.sink == peer), None)
    if edge is not None:
        return _host_of(edge.sink_address)
    near = next((a for a in routable if any(_same_subnet(a, o) for o in ours)), None)
    return near or (routable[0] if routable else None)


def peer_url(state: State, local: NodeId, peer: NodeId, ours: set[str]) -> str | None:
    port = state.node_api_ports.get(peer)
    host = peer_address(state, local, peer, ours)
    if port is None or host is None:
        return None
    return peer_tls.base_url(host, port)


def known_peers(state: State, local: NodeId) -> list[NodeId]:
    """Every node the state mentions, including placement nodes that stopped reporting (they matter most)."""
    placed = {n for inst in state.instances.values() for n in inst.shard_assignments.node_to_runner}
    nodes = {*state.node_api_ports, *state.topology.nodes, *state.last_seen, *placed}
    return sorted(n for n in nodes if n != local)


async def fetch_peer(
    client: httpx.AsyncClient, node_id: NodeId, url: str | None, timeout: float
) -> ClusterNodeDiagnostics:
    """Never raises: every failure is described in `error`."""
    if url is None:
        return ClusterNodeDiagnostics(node_id=node_id, ok=False, error="no API address known for this node")
    try:
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can drop a cancel
            response = await client.get(url + NODE_PATH, timeout=timeout, auth=internal_auth.signer(node_id))
        if response.status_code != 200:
            return ClusterNodeDiagnostics(
                node_id=node_id,
                url=url,
                ok=False,
                error=f"HTTP {response.status_code}: {response.text[:200]}",
            )
        bundle = NodeDiagnostics.model_validate(response.json())
    except (TimeoutError, httpx.TimeoutException):
        error = f"timed out after {timeout:g} s"
        return ClusterNodeDiagnostics(node_id=node_id, url=url, ok=False, error=error)
    except (httpx.HTTPError, OSError, ValueError, ValidationError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
        return ClusterNodeDiagnostics(node_id=node_id, url=url, ok=False, error=error)
    return ClusterNodeDiagnostics(node_id=node_id, url=url, ok=True, diagnostics=bundle)


async def fetch_peers(
    state: State,
    local: NodeId,
    peers: list[NodeId],
    timeout: float = DEFAULT_PEER_TIMEOUT_S,
    ours: set[str] | None = None,
) -> list[ClusterNodeDiagnostics]:
    """All peers at once; total time is one timeout, not one per peer."""
    ours = local_addresses() if ours is None else ours
    async with httpx.AsyncClient(trust_env=False, verify=peer_tls.verify()) as client:
        return list(
            await asyncio.gather(*(fetch_peer(client, p, peer_url(state, local, p, ours), timeout) for p in peers))
        )


@dataclass(frozen=True)
class DepartedPeer:
    """A node that left the cluster recently: state forgets it at once, an operator should not."""

    url: str | None
    left_at: datetime


async def fetch_departed(departed: Mapping[NodeId, DepartedPeer], timeout: float) -> list[ClusterNodeDiagnostics]:
    """Departed nodes are always reported ok: false, with why they could not be read."""
    async with httpx.AsyncClient(trust_env=False, verify=peer_tls.verify()) as client:
        found = await asyncio.gather(*(fetch_peer(client, n, d.url, timeout) for n, d in departed.items()))
    return [
        ClusterNodeDiagnostics(
            node_id=entry.node_id,
            url=entry.url,
            ok=False,
            error=f"left the cluster at {iso(peer.left_at)}"
            + (f"; {entry.error}" if entry.error else "; its API still answers but it is not a member"),
        )
        for entry, peer in zip(found, departed.values(), strict=True)
    ]


async def collect_cluster(
    local_bundle: NodeDiagnostics,
    state: State,
    local: NodeId,
    master: NodeId | None,
    timeout: float = DEFAULT_PEER_TIMEOUT_S,
    ours: set[str] | None = None,
    departed: Mapping[NodeId, DepartedPeer] | None = None,
) -> ClusterDiagnostics:
    known = known_peers(state, local)
    peers = await fetch_peers(state, local, known, timeout, ours)
    gone = {n: d for n, d in (departed or {}).items() if n not in known and n != local}
    peers += await fetch_departed(gone, timeout)
    me = ClusterNodeDiagnostics(node_id=local, ok=True, diagnostics=local_bundle)
    return ClusterDiagnostics(
        generated_at=iso(utc_now()),
        local_node_id=local,
        master_node_id=master,
        nodes=[me, *peers],
    )
