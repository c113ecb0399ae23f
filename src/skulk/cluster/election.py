"""Master election: one master per term, agreed by every node from the same heartbeats.

The pure part, `decide`, turns what a node has heard into a (master, term) decision; every node runs it over
the same inputs, so they converge without a voting round. The shell, `Elector`, heartbeats this node's
Candidate, collects its peers', and re-runs `decide` whenever a heartbeat or the alive set changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from skulk.types.ids import NodeId

from .membership import Membership
from .transport import Transport

log = logging.getLogger(__name__)

ELECTION_PREFIX = "election/"
HEARTBEAT_S = 0.25
SCOUT_S = 0.5
"""How long a starting node listens for peers before it may elect itself: long enough for heartbeats of
already-connected peers to arrive (they come every HEARTBEAT_S), short enough to keep a lone start fast."""


@dataclass(frozen=True)
class Candidate:
    """What one node says about itself: the term it is in, since when it is up, and whom it follows."""

    node_id: NodeId
    term: int
    joined_at: float
    master: NodeId | None


@dataclass(frozen=True)
class Decision:
    """kept: an existing healthy master stays; otherwise `master` is newly elected for `term`."""

    master: NodeId
    term: int
    kept: bool


_CANDIDATE = TypeAdapter(Candidate)


def encode_candidate(candidate: Candidate) -> bytes:
    return _CANDIDATE.dump_json(candidate)


def decode_candidate(payload: bytes) -> Candidate | None:
    try:
        return _CANDIDATE.validate_json(payload)
    except ValidationError:
        return None


def rank(candidate: Candidate) -> tuple[int, float, str]:
    """Sort key, best first: highest term, then seniority (earliest joined_at), then smallest node id."""
    return (-candidate.term, candidate.joined_at, candidate.node_id)


def decide(candidates: Iterable[Candidate], alive: frozenset[NodeId], me: NodeId) -> Decision:
    """The (master, term) every node reaches from the same candidates and alive set.

    Keep the master if exactly one live master is acknowledged at the highest term: a rejoining node (low
    term) never takes over a healthy master. Otherwise (no master, a dead one, or a split with two) elect the
    best-ranked live candidate under a fresh term, so the new session is distinct from every earlier one.
    """
    live_nodes = alive | {me}
    live = [c for c in candidates if c.node_id in live_nodes]
    if not live:
        raise ValueError("decide needs at least this node's own candidate")
    top = max(c.term for c in live)
    acknowledged = {c.master for c in live if c.term == top and c.master in live_nodes}
    if len(acknowledged) == 1:
        (master,) = acknowledged
        if master is not None:
            return Decision(master=master, term=top, kept=True)
    best = min(live, key=rank)
    return Decision(master=best.node_id, term=top + 1, kept=False)


def ready_to_settle(
    elapsed: float,
    alive: frozenset[NodeId],
    heard: frozenset[NodeId],
    found_master: bool,
    timeout_s: float,
    expect_peers: bool = False,
) -> bool:
    """A starting node may decide once it found a healthy master, or has heard every live peer after the
    scouting window, or has waited half the election timeout (a live peer that never heartbeats is not
    allowed to stall the cluster)."""
    if found_master:
        return True
    if elapsed >= timeout_s / 2:
        return True
    if expect_peers and len(alive) < 2:
        return False  # bootstrap peers are configured but not connected yet: electing alone splits the brain
    return elapsed >= SCOUT_S and alive <= heard


class Elector:
    """Heartbeats this node's Candidate on `election/<node_id>` and follows `decide` over its peers'.

    Everything runs on the asyncio loop; callbacks of on_master_changed are called there, in order.
    """

    def __init__(
        self,
        transport: Transport,
        membership: Membership,
        node_id: NodeId,
        joined_at: float,
        *,
        timeout_s: float = 3.0,
        expect_peers: bool = False,
    ) -> None:
        self._transport = transport
        self.expect_peers = expect_peers
        self._membership = membership
        self.node_id = node_id
        self.joined_at = joined_at
        self.timeout_s = timeout_s
        self._master: NodeId | None = None
        self._term = 0
        self._heard: dict[NodeId, Candidate] = {}
        self._settled = False
        self._started_at = 0.0
        self._stopping = asyncio.Event()
        self._callbacks: list[Callable[[NodeId, int], None]] = []
        self._changed: asyncio.Event = asyncio.Event()

    @property
    def master_id(self) -> NodeId | None:
        return self._master

    @property
    def term(self) -> int:
        return self._term

    @property
    def is_master(self) -> bool:
        return self._master == self.node_id

    def me(self) -> Candidate:
        return Candidate(node_id=self.node_id, term=self._term, joined_at=self.joined_at, master=self._master)

    def on_master_changed(self, callback: Callable[[NodeId, int], None]) -> None:
        """callback(master, term) on the asyncio loop each time this node adopts a new (master, term)."""
        self._callbacks.append(callback)

    async def wait_for_master(self, timeout: float) -> NodeId:
        """The master once there is one; raises TimeoutError after timeout seconds."""
        async with asyncio.timeout(timeout):
            while self._master is None:
                self._changed.clear()
                await self._changed.wait()
        return self._master

    async def run(self) -> None:
        """Heartbeat and decide until stop(). The first decision waits for the scouting window."""
        loop = asyncio.get_running_loop()
        self._started_at = loop.time()
        sub = self._transport.subscribe(ELECTION_PREFIX + "*", self._on_heartbeat)
        self._membership.on_change(self._on_membership)
        settle_timer = loop.call_later(SCOUT_S, self._step)
        try:
            while not self._stopping.is_set():
                self._publish()
                self._step()
                try:
                    await asyncio.wait_for(self._stopping.wait(), HEARTBEAT_S)
                except TimeoutError:
                    pass
        finally:
            settle_timer.cancel()
            if self._transport.is_open:
                self._transport.undeclare(sub)

    def stop(self) -> None:
        self._stopping.set()

    def _on_heartbeat(self, key: str, payload: bytes) -> None:
        candidate = decode_candidate(payload)
        if candidate is None or candidate.node_id == self.node_id:
            return
        if key != ELECTION_PREFIX + candidate.node_id:
            return  # a heartbeat must come from the node it names
        self._heard[candidate.node_id] = candidate
        self._step()

    def _on_membership(self, node: NodeId, alive: bool) -> None:
        if not alive:
            self._heard.pop(node, None)
        self._step()

    def _step(self) -> None:
        """Re-run decide over what we know; adopt and announce the result if it changed."""
        if self._stopping.is_set():
            return
        alive = self._membership.alive
        decision = decide([self.me(), *self._heard.values()], alive, self.node_id)
        if not self._settled:
            elapsed = asyncio.get_running_loop().time() - self._started_at
            heard = frozenset(self._heard) | {self.node_id}
            if not ready_to_settle(elapsed, alive, heard, decision.kept, self.timeout_s, self.expect_peers):
                return
            self._settled = True
        if (decision.master, decision.term) == (self._master, self._term):
            return
        self._adopt(decision)

    def _adopt(self, decision: Decision) -> None:
        log.info("node %s: master %s term %d (%s)", self.node_id, decision.master, decision.term,
                 "kept" if decision.kept else "elected")
        self._master, self._term = decision.master, decision.term
        self._publish()
        self._changed.set()
        for callback in list(self._callbacks):
            try:
                callback(decision.master, decision.term)
            except Exception:
                log.exception("on_master_changed callback failed")

    def _publish(self) -> None:
        """Best effort: a closed transport (this node is going away) just stops heartbeating."""
        if not self._transport.is_open:
            return
        try:
            self._transport.put(ELECTION_PREFIX + self.node_id, encode_candidate(self.me()))
        except Exception as exc:
            log.debug("heartbeat of %s not sent: %s", self.node_id, exc)
