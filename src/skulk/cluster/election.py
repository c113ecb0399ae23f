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
ELECTION_HEARTBEAT_S = 0.25
"""How often every node publishes its candidate record under `election/` (peers hold it as alive while it keeps
coming) and re-decides who is master."""
SCOUT_S = 0.5
"""How long a starting node listens for peers before it may elect itself: long enough for heartbeats of
already-connected peers to arrive (they come every ELECTION_HEARTBEAT_S), short enough to keep a cluster start fast."""
VACANCY_S = 0.5
"""With no live master, wait this long (two heartbeats) before electing: the last events of the old master are
still arriving, and every candidate's applied index must reach the others before the up-to-date rule can pick
the same winner everywhere."""
FROZEN_GAP_S = 2.5
"""A gap this long between two heartbeat ticks means this process was frozen (SIGSTOP, a closed laptop lid)
or starved: everything it believes about its peers' liveness is stale, and the lease (3 s) may have run out."""


@dataclass(frozen=True)
class Candidate:
    """What one node says about itself: its term, since when it is up, whom it follows, how far its state is
    (applied_idx: the last event it applied), and whether it is rejoining after a pause (then it may not win)."""

    node_id: NodeId
    term: int
    joined_at: float
    master: NodeId | None
    applied_idx: int = -1
    rejoining: bool = False


@dataclass(frozen=True)
class Decision:
    """kept: an existing live master stays; otherwise `master` is newly elected for `term`."""

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
    """Sort key of a fresh election, best first: the most advanced state (Raft's up-to-date rule: a node that
    missed events must not overwrite the others with its older snapshot), then seniority, then node id."""
    return (-candidate.applied_idx, candidate.joined_at, candidate.node_id)


def support(live: dict[NodeId, Candidate]) -> dict[NodeId, int]:
    """Live masters and how many live nodes (the master included) follow each in its own term.

    A master counts only while it claims itself: a node that stepped down (paused, rejoining) stops
    claiming at once, so its old followers cannot keep it master."""
    counts: dict[NodeId, int] = {}
    for c in live.values():
        master = live.get(c.master) if c.master is not None else None
        if master is None or master.master != master.node_id or c.term != master.term:
            continue
        counts[master.node_id] = counts.get(master.node_id, 0) + 1
    return counts


def decide(candidates: Iterable[Candidate], alive: frozenset[NodeId], me: NodeId) -> Decision:
    """The (master, term) every node reaches from the same candidates and alive set.

    A live master is kept, and a node that rejoins never takes over. When two live masters meet (either side
    of a healed partition, or a node that ran alone while cut off), the one followed by more nodes wins, then
    the one with the more advanced state: terms alone would let a lone node that kept electing itself wipe
    the majority's state. With no live master, the best-ranked live candidate that is not rejoining is
    elected; the term is the one a peer already acknowledged it in, else a fresh one.
    """
    live_nodes = alive | {me}
    live = {c.node_id: c for c in candidates if c.node_id in live_nodes}
    if me not in live:
        raise ValueError("decide needs this node's own candidate")
    masters = support(live)
    if masters:
        best = min(masters, key=lambda m: (-masters[m], -live[m].applied_idx, live[m].joined_at, m))
        return Decision(master=best, term=live[best].term, kept=True)
    eligible = [c for c in live.values() if not c.rejoining] or list(live.values())
    winner = min(eligible, key=rank)
    top = max(c.term for c in live.values())
    acknowledged = any(c.master == winner.node_id and c.term == top for c in live.values())
    return Decision(master=winner.node_id, term=top if acknowledged else top + 1, kept=False)


def ready_to_settle(
    elapsed: float, alive: frozenset[NodeId], heard: frozenset[NodeId], found_master: bool, wait_s: float
) -> bool:
    """A starting (or rejoining) node may decide once it found a live master; or, among peers that all start
    together (every live peer heard, none master), after the scouting window; or alone after wait_s.

    Waiting the whole election timeout when alone is what lets a restarted node find the existing cluster
    (its peers redial within a second) instead of running as a lone master with an empty state."""
    if found_master or elapsed >= wait_s:
        return True
    return len(alive) > 1 and elapsed >= SCOUT_S and alive <= heard


class Elector:
    """Heartbeats this node's Candidate on `election/<node_id>` and follows `decide` over its peers'.

    Everything runs on the asyncio loop; callbacks of on_master_changed are called there, in order, with the
    new (master, term), or (None, term) when this node steps down after being frozen.
    """

    def __init__(
        self,
        transport: Transport,
        membership: Membership,
        node_id: NodeId,
        joined_at: float,
        *,
        timeout_s: float = 3.0,
        rejoin_wait_s: float = 10.0,
        applied_idx: Callable[[], int] = lambda: -1,
    ) -> None:
        self._transport = transport
        self._membership = membership
        self.node_id = node_id
        self.joined_at = joined_at
        self.timeout_s = timeout_s
        self.rejoin_wait_s = rejoin_wait_s
        self._applied_idx = applied_idx
        self._master: NodeId | None = None
        self._term = 0
        self._heard: dict[NodeId, Candidate] = {}
        self._settled = False
        self._rejoining = False
        self._window_start = 0.0
        self._window_s = timeout_s
        self._last_tick = 0.0
        self._vacant_since: float | None = None
        self._stopping = asyncio.Event()
        self._callbacks: list[Callable[[NodeId | None, int], None]] = []
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

    def master_applied_idx(self) -> int | None:
        """The last event the master we follow said (in its heartbeat) it applied; None when we lead or
        have not heard it this term."""
        if self._master is None or self._master == self.node_id:
            return None
        heard = self._heard.get(self._master)
        return heard.applied_idx if heard is not None and heard.term == self._term else None

    @property
    def settled(self) -> bool:
        return self._settled

    def frozen(self) -> bool:
        """True while this process has just come back from a freeze and the election has not noticed yet:
        its view of who is alive is stale, so no decision about peers may be taken on it."""
        loop = asyncio.get_running_loop()
        return self._last_tick > 0 and loop.time() - self._last_tick > FROZEN_GAP_S

    def me(self) -> Candidate:
        return Candidate(
            node_id=self.node_id,
            term=self._term,
            joined_at=self.joined_at,
            master=self._master,
            applied_idx=self._applied_idx(),
            rejoining=self._rejoining,
        )

    def on_master_changed(self, callback: Callable[[NodeId | None, int], None]) -> None:
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
        self._window_start = self._last_tick = loop.time()
        sub = self._transport.subscribe(ELECTION_PREFIX + "*", self._on_heartbeat)
        self._membership.on_change(self._on_membership)
        settle_timer = loop.call_later(SCOUT_S, self._step)
        try:
            while not self._stopping.is_set():
                self._tick(loop.time())
                self._membership.expire(loop.time())
                self._publish()
                self._step()
                try:
                    async with asyncio.timeout(ELECTION_HEARTBEAT_S):  # not wait_for: on 3.11 it can drop a cancel
                        await self._stopping.wait()
                except TimeoutError:
                    pass
        finally:
            settle_timer.cancel()
            if self._transport.is_open:
                self._transport.undeclare(sub)

    def stop(self) -> None:
        self._stopping.set()

    def _tick(self, now: float) -> None:
        gap = now - self._last_tick
        self._last_tick = now
        if gap > FROZEN_GAP_S:
            self._rejoin(gap, now)

    def _rejoin(self, gap: float, now: float) -> None:
        """Back from a freeze: forget what we heard, step down if we were master, and wait to hear the
        cluster again before deciding anything; meanwhile we may not be elected (we may be behind).

        A master that was alone stays master in its term: no peer could have replaced it, and stepping down
        would end every open request of a one-node cluster whose loop merely stalled under load (a new term
        is a new session). A peer that came up during the freeze and elected itself meets a second live
        master, and `decide` settles that as it settles a healed partition."""
        self._membership.forgive(now)
        if self.is_master and not self._heard and self._membership.alive <= {self.node_id}:
            log.warning("node %s stalled for %.1f s with no peer: still master in term %d",
                        self.node_id[:8], gap, self._term)
            return
        log.warning(
            "node %s was frozen for %.1f s; its view of the cluster is stale: rejoining as a follower",
            self.node_id[:8], gap,
        )
        self._heard.clear()
        self._settled = False
        self._rejoining = True
        self._window_start, self._window_s = now, self.rejoin_wait_s
        if self._master is not None:
            self._master = None
            self._announce()

    def _on_heartbeat(self, key: str, payload: bytes) -> None:
        candidate = decode_candidate(payload)
        if candidate is None or candidate.node_id == self.node_id:
            return
        if key != ELECTION_PREFIX + candidate.node_id:
            return  # a heartbeat must come from the node it names
        self._heard[candidate.node_id] = candidate
        self._membership.vouch(candidate.node_id, asyncio.get_running_loop().time())  # it opened: sealed by a peer
        self._step()

    def _on_membership(self, node: NodeId, alive: bool) -> None:
        if not alive:
            self._heard.pop(node, None)
        self._step()

    def _step(self) -> None:
        """Re-run decide over what we know; adopt and announce the result if it changed."""
        if self._stopping.is_set() or self.frozen():
            return
        alive = self._membership.alive
        decision = decide([self.me(), *self._heard.values()], alive, self.node_id)
        waiting = self._vacancy_open(decision)
        if not self._settled:
            now = asyncio.get_running_loop().time()
            elapsed = now - self._window_start
            heard = frozenset(self._heard) | {self.node_id}
            present = alive | self._membership.unheard(now)  # peers whose first sealed heartbeat is on its way
            if not ready_to_settle(elapsed, present, heard, decision.kept, self._window_s):
                return
            self._settled, self._rejoining = True, False
            if not decision.kept:  # the rejoin flag kept us out; decide again now that we may stand
                decision = decide([self.me(), *self._heard.values()], alive, self.node_id)
        if (decision.master, decision.term) == (self._master, self._term) or waiting:
            return
        self._adopt(decision)

    def _vacancy_open(self, decision: Decision) -> bool:
        """True while a fresh election must still wait for everyone's latest applied index (VACANCY_S)."""
        if decision.kept:
            self._vacant_since = None
            return False
        now = asyncio.get_running_loop().time()
        if self._vacant_since is None:
            self._vacant_since = now
        return now - self._vacant_since < VACANCY_S

    def _adopt(self, decision: Decision) -> None:
        how = "kept" if decision.kept else "elected"
        if decision.master == self.node_id:
            how = "won" if not decision.kept else "kept (this node)"
        alive = len(self._membership.alive)
        log.info("master %s term %d (%s; %d live %s)", decision.master[:8], decision.term, how, alive,
                 "node" if alive == 1 else "nodes")
        self._master, self._term = decision.master, decision.term
        self._announce()

    def _announce(self) -> None:
        self._publish()
        self._changed.set()
        for callback in list(self._callbacks):
            try:
                callback(self._master, self._term)
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
