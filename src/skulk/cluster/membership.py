"""Who is in the cluster right now, from zenoh liveliness tokens.

Each node holds the token `alive/<node_id>` for as long as its session lives. zenoh drops a peer's tokens the
moment its TCP link closes (a `kill -9` is seen in milliseconds) or when the 3 s lease runs out (a hung or
cut-off peer), so the alive set is the cluster's failure detector: nothing here polls or times out by itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from skulk.types.ids import NodeId

from .transport import Transport

log = logging.getLogger(__name__)

ALIVE_PREFIX = "alive/"


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
        self._callbacks: list[Callable[[NodeId, bool], None]] = []
        self._waiters: set[asyncio.Future[None]] = set()
        self._entities: list[object] = []

    @property
    def alive(self) -> frozenset[NodeId]:
        return self._alive

    def start(self) -> None:
        """Declare our own token, then watch everyone's (history included, so peers already up are seen)."""
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
        self._set(node, alive)

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
