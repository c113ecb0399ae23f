"""Who is in the cluster right now, from zenoh liveliness tokens.

Each node holds the token `alive/<node_id>` for as long as its session lives. zenoh drops a peer's tokens the
moment its TCP link closes (a `kill -9` is seen in milliseconds) or when the 3 s lease runs out (a hung or
cut-off peer), so the alive set is the cluster's failure detector.

Liveliness tokens are not sealed: any zenoh client can declare `alive/<id>` (ids are visible to anyone on the
network), and one that declared the id of a master kept that master alive after it died, blocking failover for
as long as it held the token (issue 27). So with a cluster key a token alone makes nobody a member: a node is
alive while it holds its token *and* its sealed election heartbeat was heard within the lease (VOUCH_LEASE_S,
the same 3 s zenoh gives a hung peer). A phantom token then adds no member, and a dead master whose id someone
else holds leaves when its heartbeats stop, one lease later, as a hung one does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from skulk.types.ids import NodeId

from .transport import Transport

log = logging.getLogger(__name__)

ALIVE_PREFIX = "alive/"
VOUCH_LEASE_S = 3.0
"""A member whose sealed heartbeat was not heard for this long is gone, whatever tokens say (zenoh's lease)."""


def node_of(key: str) -> NodeId | None:
    """The node id in a liveliness key `alive/<node_id>`, or None for a key that is not one."""
    if not key.startswith(ALIVE_PREFIX) or len(key) == len(ALIVE_PREFIX):
        return None
    return NodeId(key[len(ALIVE_PREFIX) :])


class Membership:
    """The live set of node ids, including this node, kept on the asyncio loop."""

    def __init__(self, transport: Transport, node_id: NodeId) -> None:
        self._transport = transport
        self.node_id = node_id
        self._alive: frozenset[NodeId] = frozenset()
        self._tokens: set[NodeId] = set()
        self._token_since: dict[NodeId, float] = {}
        self._vouched: dict[NodeId, float] = {}
        self.needs_vouching = transport.sealer is not None
        """With a cluster key, membership needs a sealed heartbeat besides the (unsealed) token."""
        self._callbacks: list[Callable[[NodeId, bool], None]] = []
        self._waiters: set[asyncio.Future[None]] = set()
        self._entities: list[object] = []

    @property
    def alive(self) -> frozenset[NodeId]:
        return self._alive

    @property
    def tokens(self) -> frozenset[NodeId]:
        """Every id that holds a liveliness token, vouched for or not (diagnostics: a phantom shows here only)."""
        return frozenset(self._tokens)

    def unheard(self, now: float) -> frozenset[NodeId]:
        """Token holders not vouched for yet whose token is younger than the lease: peers whose first sealed
        heartbeat is still on its way. A starting node waits to hear them before it settles an election; a
        token older than the lease without a heartbeat is a phantom and is not waited for."""
        if not self.needs_vouching:
            return frozenset()
        return frozenset(n for n in self._tokens - self._alive
                         if now - self._token_since.get(n, now) <= VOUCH_LEASE_S)

    def vouch(self, node: NodeId, now: float) -> None:
        """A sealed heartbeat of `node` was heard at `now` (loop time): it is a member while its token lives."""
        self._vouched[node] = now
        self._update(node)

    def expire(self, now: float) -> None:
        """Members whose last sealed heartbeat is older than the lease leave (called every heartbeat tick)."""
        for node in [n for n, heard in self._vouched.items() if now - heard > VOUCH_LEASE_S]:
            if node in self._tokens:
                log.warning("node %s still has a liveliness token but sent no sealed heartbeat for %.1f s: gone (hung, "
                            "or the token is not its own)", node[:8], now - self._vouched[node])
            del self._vouched[node]
            self._update(node)

    def forgive(self, now: float) -> None:
        """Back from a freeze of this process: every heartbeat looks old only because we did not run; each
        member gets a fresh lease (its heartbeats resume at once, or it leaves one lease from now)."""
        for node in self._vouched:
            self._vouched[node] = now

    def start(self) -> None:
        """Declare our own token, then watch everyone's (history included, so peers already up are seen)."""
        self._tokens.add(self.node_id)
        self._set(self.node_id, True)
        self._entities.append(self._transport.declare_token(ALIVE_PREFIX + self.node_id))
        self._entities.append(self._transport.watch_liveliness(ALIVE_PREFIX + "*", self._on_token))

    def stop(self) -> None:
        for entity in reversed(self._entities):
            self._transport.undeclare(entity)
        self._entities.clear()

    def on_change(self, callback: Callable[[NodeId, bool], None]) -> None:
        """callback(node_id, alive) on the asyncio loop, once per actual change of the alive set."""
        self._callbacks.append(callback)

    async def wait_for(
        self, predicate: Callable[[frozenset[NodeId]], bool], timeout: float
    ) -> frozenset[NodeId]:
        """Wait until predicate(alive) holds; raises TimeoutError after timeout seconds."""
        async with asyncio.timeout(timeout):
            while not predicate(self._alive):
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.add(waiter)
                try:
                    await waiter
                finally:
                    self._waiters.discard(waiter)
        return self._alive

    def _on_token(self, key: str, alive: bool) -> None:
        node = node_of(key)
        if node is None:
            return
        if node == self.node_id and not alive and self._transport.is_open:
            # Our own token only goes away with our session; a stray delete must not make us think we left.
            return
        if alive:
            self._tokens.add(node)
            self._token_since.setdefault(node, asyncio.get_running_loop().time())
        else:
            self._tokens.discard(node)
            self._token_since.pop(node, None)
        self._update(node)

    def _update(self, node: NodeId) -> None:
        trusted = node == self.node_id or not self.needs_vouching or node in self._vouched
        self._set(node, (node in self._tokens and trusted) or node == self.node_id)

    def _set(self, node: NodeId, alive: bool) -> None:
        if (node in self._alive) == alive:
            return
        self._alive = self._alive | {node} if alive else self._alive - {node}
        log.debug("membership %s: %s %s", self.node_id, node, "joined" if alive else "left")
        for callback in list(self._callbacks):
            try:
                callback(node, alive)
            except Exception:
                log.exception("membership callback failed")
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
