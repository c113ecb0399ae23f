"""Candidate rings for placement: node sets whose ranks can pass activations around a directed cycle.

Pure graph code over `Topology`; no memory, no models. A ring is a tuple of node ids in rank order:
rank i reaches rank i+1 and the last rank reaches rank 0. One node is always a ring; two nodes need edges
both ways; three or more need a directed Hamiltonian cycle, found by brute force, which is why ring sizes
and the number of node sets tried per size are capped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

from skulk.types.ids import NodeId
from skulk.types.node_info import Connection, Topology

MAX_CYCLE_NODES = 8
"""Largest ring considered: brute force stays at most 7! orderings per node set."""

MAX_SETS_PER_SIZE = 1_000
"""Node sets tried per ring size (all of them up to 12 nodes); past it the highest ids are skipped."""

LOOPBACK = "127.0.0.1"

Ring = tuple[NodeId, ...]
Adjacency = dict[NodeId, frozenset[NodeId]]


def live_nodes(topology: Topology, excluded: Iterable[NodeId]) -> list[NodeId]:
    """Topology nodes minus exclusions, sorted; unknown excluded ids are ignored (ids are per-session)."""
    skip = set(excluded)
    return sorted({n for n in topology.nodes if n not in skip})


def adjacency(topology: Topology, nodes: Sequence[NodeId]) -> Adjacency:
    """Out-neighbours among `nodes` only: edges to excluded or unknown nodes cannot carry a ring."""
    members = set(nodes)
    out: dict[NodeId, set[NodeId]] = {n: set() for n in nodes}
    for c in topology.connections:
        if c.source in members and c.sink in members and c.source != c.sink:
            out[c.source].add(c.sink)
    return {n: frozenset(s) for n, s in out.items()}


def _hamiltonian_orders(members: Sequence[NodeId], adj: Adjacency) -> Iterator[Ring]:
    """Directed cycles through all members starting at members[0], in lexicographic order."""
    start, size = members[0], len(members)
    allowed = frozenset(members)

    def extend(path: list[NodeId]) -> Iterator[Ring]:
        if len(path) == size:
            if start in adj[path[-1]]:
                yield tuple(path)
            return
        for nxt in sorted((adj[path[-1]] & allowed).difference(path)):
            path.append(nxt)
            yield from extend(path)
            path.pop()

    yield from extend([start])


def find_ring(members: Sequence[NodeId], adj: Adjacency) -> Ring | None:
    """The ring over exactly `members` (sorted), rank 0 = smallest id, or None when they form no cycle.

    Among the orderings, prefer one where rank 1 also reaches rank 0 directly, because the rendezvous
    address is the one rank 1 uses to reach rank 0; any ring's closing edge is the fallback.
    """
    if len(members) == 1:
        return (members[0],)
    if len(members) == 2:
        a, b = members
        return (a, b) if b in adj[a] and a in adj[b] else None
    if any(not (adj[m] & set(members)) for m in members):
        return None
    first: Ring | None = None
    for ring in _hamiltonian_orders(members, adj):
        if ring[0] in adj[ring[1]]:
            return ring
        first = first or ring
    return first


def rings_of_size(nodes: Sequence[NodeId], adj: Adjacency, size: int) -> Iterator[Ring]:
    """Every ring of exactly `size` of `nodes`, node sets in sorted order, capped at MAX_SETS_PER_SIZE."""
    if size < 1 or size > min(len(nodes), MAX_CYCLE_NODES):
        return
    for members in itertools.islice(itertools.combinations(sorted(nodes), size), MAX_SETS_PER_SIZE):
        ring = find_ring(members, adj)
        if ring is not None:
            yield ring


def largest_ring_size(nodes: Sequence[NodeId], adj: Adjacency, below: int) -> int:
    """Size of the largest ring smaller than `below`, for telling the operator how far off they are."""
    for size in range(min(below - 1, len(nodes), MAX_CYCLE_NODES), 0, -1):
        if next(rings_of_size(nodes, adj, size), None) is not None:
            return size
    return 0


def ring_hosts(connections: Sequence[Connection], ranks: Sequence[NodeId], port: int) -> list[str]:
    """MLX's ring hostfile: where each rank listens (rank r on port + r), at the address its predecessor uses
    for it, else its successor's; every rank on loopback for a single node."""
    if len(ranks) == 1:
        return [f"{LOOPBACK}:{port}"]
    hosts = []
    for r, node in enumerate(ranks):
        before, after = ranks[r - 1], ranks[(r + 1) % len(ranks)]
        host = _sink_address(connections, before, node) or _sink_address(connections, after, node) or LOOPBACK
        hosts.append(f"{host}:{port + r}")
    return hosts


def _sink_address(connections: Sequence[Connection], source: NodeId, sink: NodeId) -> str | None:
    """First listed address at which `source` reaches `sink` (state order is the same on every node)."""
    return next((c.sink_address for c in connections if c.source == source and c.sink == sink), None)


def rendezvous_host(connections: Sequence[Connection], ring: Ring) -> str:
    """Where the ranks meet rank 0: the address rank 1 uses for it, else the ring's closing edge's."""
    if len(ring) == 1:
        return LOOPBACK
    host = _sink_address(connections, ring[1], ring[0]) or _sink_address(connections, ring[-1], ring[0])
    if host is None:
        raise ValueError(f"ring {ring} has no edge into rank 0; rings come from find_ring only")
    return host
