"""The control plane over real zenoh sessions on loopback: membership, election, ordered event sync.

Every test builds its own cluster name and ports, so tests never hear each other; every session is closed in
teardown. Waits are on callbacks, not sleeps, except where a test checks that nothing changes.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from skulk.cluster.election import Elector
from skulk.cluster.membership import Membership
from skulk.cluster.sync import EventFollower, Intake, Sequencer, send_command, send_local_event
from skulk.cluster.transport import Transport, TransportSettings
from skulk.state.apply import apply
from skulk.testing.nodes import free_port
from skulk.types.commands import DeleteInstance, ForwardedCommand
from skulk.types.events import Event, IndexedEvent, LocalEvent, NodeTimedOut, SessionStarted
from skulk.types.ids import CommandId, InstanceId, NodeId
from skulk.types.state import State

pytestmark = pytest.mark.integration


@dataclass
class Node:
    node_id: NodeId
    transport: Transport
    membership: Membership
    elector: Elector | None = None
    task: asyncio.Task[None] | None = None
    seen: list[tuple[NodeId, int]] = field(default_factory=list)


class Cluster:
    """Nodes on 127.0.0.1; each new node dials the ones before it and zenoh gossip completes the mesh."""

    def __init__(self) -> None:
        self.name = f"t-{uuid.uuid4().hex[:12]}"
        self.endpoints: list[str] = []
        self.nodes: list[Node] = []
        self.changed = asyncio.Event()

    def transport(self) -> Transport:
        endpoint = f"tcp/127.0.0.1:{free_port()}"
        settings = TransportSettings(
            cluster=self.name, listen=[endpoint], bootstrap_peers=list(self.endpoints), multicast=False
        )
        transport = Transport(settings)
        transport.open()
        self.endpoints.append(endpoint)
        return transport

    def node(
        self, name: str, *, joined_at: float | None = None, elect: bool = True, timeout_s: float = 3.0
    ) -> Node:
        """A node with membership (and an elector unless elect=False), started on the running loop."""
        node_id = NodeId(name)
        transport = self.transport()
        node = Node(node_id, transport, Membership(transport, node_id))
        self.nodes.append(node)
        node.membership.on_change(lambda _n, _a: self.changed.set())
        node.membership.start()
        if elect:
            node.elector = Elector(
                transport, node.membership, node_id, joined_at or time.time(), timeout_s=timeout_s
            )
            node.elector.on_master_changed(lambda m, t, node=node: self._record(node, m, t))
            node.task = asyncio.get_running_loop().create_task(node.elector.run())
        return node

    def _record(self, node: Node, master: NodeId, term: int) -> None:
        node.seen.append((master, term))
        self.changed.set()

    async def until(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait for predicate() to hold, re-checking on every election or membership change."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        for node in self.nodes:
            if node.elector is not None:
                node.elector.stop()
            if node.task is not None:
                await node.task
            node.membership.stop()
            node.transport.close()


def agreed(nodes: list[Node]) -> tuple[NodeId, int] | None:
    """The (master, term) every node holds, if they all hold the same one and exactly one is master."""
    views = {(n.elector.master_id, n.elector.term) for n in nodes if n.elector is not None}
    masters = [n for n in nodes if n.elector is not None and n.elector.is_master]
    if len(views) != 1 or len(masters) != 1:
        return None
    (master, term), = views
    return (master, term) if master is not None else None


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        await c.close()


@pytest.mark.timeout(30)
async def test_lone_node_becomes_master_quickly(cluster: Cluster) -> None:
    """Alone, a node waits the election timeout (here 1 s) for an existing cluster, then elects itself. Never
    sooner (that can fail, whatever the load); how soon after is a speed, measured by bench/cluster.py, not
    asserted here (a loaded machine delays it without anything being wrong)."""
    start = time.monotonic()
    node = cluster.node("solo", timeout_s=1.0)
    assert node.elector is not None
    assert await node.elector.wait_for_master(20.0) == node.node_id
    elapsed = time.monotonic() - start
    print(f"lone master elected in {elapsed:.3f}s (transport open included)")
    assert node.elector.term == 1
    assert elapsed >= 1.0


@pytest.mark.timeout(30)
async def test_three_nodes_converge_on_one_master_and_term(cluster: Cluster) -> None:
    nodes = [cluster.node(f"n{i}", joined_at=100.0 + i) for i in range(3)]
    await cluster.until(lambda: agreed(nodes) is not None, 3.0)
    master, term = agreed(nodes) or (None, 0)
    assert master == "n0"  # the most senior
    await asyncio.sleep(0.6)  # two heartbeats: nothing may change once agreed
    assert agreed(nodes) == (master, term)
    assert all(n.seen[-1] == (master, term) for n in nodes)


@pytest.mark.timeout(30)
async def test_closing_the_master_elects_a_new_one_among_the_rest(cluster: Cluster) -> None:
    nodes = [cluster.node(f"n{i}", joined_at=100.0 + i) for i in range(3)]
    await cluster.until(lambda: agreed(nodes) is not None, 3.0)
    old_master, old_term = agreed(nodes) or (None, 0)
    master_node = next(n for n in nodes if n.node_id == old_master)
    rest = [n for n in nodes if n is not master_node]

    start = time.monotonic()
    master_node.transport.close()
    await cluster.until(lambda: (v := agreed(rest)) is not None and v[0] != old_master, 20.0)
    print(f"re-elected in {time.monotonic() - start:.3f}s after the master closed (bench/cluster.py measures it)")
    new_master, new_term = agreed(rest) or (None, 0)
    assert new_master == "n1"  # the most senior survivor
    assert new_term == old_term + 1


@pytest.mark.timeout(30)
async def test_late_joiner_adopts_the_existing_master(cluster: Cluster) -> None:
    first = [cluster.node(f"n{i}", joined_at=100.0 + i) for i in (1, 2)]
    await cluster.until(lambda: agreed(first) is not None, 3.0)
    session = agreed(first)
    before = [list(n.seen) for n in first]

    senior = cluster.node("n0", joined_at=1.0)  # more senior than everyone, yet must not take over
    assert senior.elector is not None
    await senior.elector.wait_for_master(3.0)
    everyone = [*first, senior]
    await cluster.until(lambda: agreed(everyone) is not None, 3.0)
    assert agreed(everyone) == session
    assert senior.seen == [session]
    assert [n.seen for n in first] == before


@dataclass
class Replica:
    """A follower's view: the state it built and every idx it was handed, in order."""

    state: State = field(default_factory=State)
    delivered: list[int] = field(default_factory=list)
    snapshots: list[int] = field(default_factory=list)
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    def on_event(self, event: IndexedEvent) -> None:
        self.state = apply(self.state, event)
        self.delivered.append(event.idx)
        self.progress.set()

    def on_snapshot(self, state: State) -> None:
        self.state = state
        self.snapshots.append(state.last_event_applied_idx)
        self.progress.set()

    async def reach(self, idx: int, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while self.state.last_event_applied_idx < idx:
                self.progress.clear()
                await self.progress.wait()


class Master:
    """A Sequencer that applies what it emits, like the real master; its snapshot may lag on purpose."""

    def __init__(self, transport: Transport, history_size: int = 10_000, name: str = "m") -> None:
        self.state = State()
        self.snapshot_state: State | None = None
        self.sequencer = Sequencer(
            transport, first_idx=0, snapshot=self.snapshot, history_size=history_size, term=1, master=name
        )

    def snapshot(self) -> bytes:
        return (self.snapshot_state or self.state).model_dump_json().encode()

    def emit(self, count: int) -> None:
        start = self.sequencer.next_idx
        events: list[Event] = [NodeTimedOut(node_id=NodeId(f"gone-{start + i}")) for i in range(count)]
        events.append(SessionStarted(master_node_id=NodeId("m"), term=start + count))
        for indexed in self.sequencer.emit(events):
            self.state = apply(self.state, indexed)


async def follower_node(cluster: Cluster, name: str, replica: Replica, next_idx: int = 0) -> EventFollower:
    """Subscribes before declaring its token: a peer that sees the token also routes events to it."""
    transport = cluster.transport()
    follower = EventFollower(
        transport, next_idx=next_idx, on_event=replica.on_event, on_snapshot=replica.on_snapshot
    )
    follower.follow(NodeId("m"), 1)
    follower.start()
    node = Node(NodeId(name), transport, Membership(transport, NodeId(name)))
    cluster.nodes.append(node)
    node.membership.start()
    return follower


async def master_node(cluster: Cluster, history_size: int = 10_000, name: str = "m") -> Master:
    node = cluster.node(name, elect=False)
    master = Master(node.transport, history_size, name)
    master.sequencer.start()
    return master


@pytest.mark.timeout(30)
async def test_sequencer_events_reach_followers_in_order(cluster: Cluster) -> None:
    master = await master_node(cluster)
    replicas = [Replica(), Replica()]
    followers = [await follower_node(cluster, f"f{i}", r) for i, r in enumerate(replicas)]
    for follower in followers:
        await follower.catch_up()  # a round trip to the master: its routes to our subscription are in place
    master.emit(199)
    for replica in replicas:
        await replica.reach(199)
        assert replica.delivered == list(range(200))
        assert replica.state == master.state
    for follower in followers:
        follower.stop()


@pytest.mark.timeout(30)
async def test_follower_ignores_a_second_master_of_the_same_term(cluster: Cluster) -> None:
    """Either side of a healed partition may have a master of the same term numbering the same indices: a
    follower applies only the one it follows, so it can never keep a mix of the two."""
    master = await master_node(cluster)
    rogue = await master_node(cluster, name="x")
    replica = Replica()
    follower = await follower_node(cluster, "f", replica)
    await follower.catch_up()
    rogue.emit(30)
    master.emit(9)
    await replica.reach(9)
    rogue.emit(5)
    master.emit(2)
    await replica.reach(12)
    assert replica.state == master.state
    assert replica.delivered == list(range(13))
    follower.stop()


@pytest.mark.timeout(30)
async def test_follower_that_missed_events_fills_the_gap_from_the_range(cluster: Cluster) -> None:
    master = await master_node(cluster)
    master.emit(9)  # idx 0..9 published before the follower exists
    replica = Replica()
    follower = await follower_node(cluster, "f", replica)
    await cluster.nodes[0].membership.wait_for(lambda alive: "f" in alive, 3.0)
    master.emit(4)  # idx 10..14 arrive live and reveal the gap
    await replica.reach(14)
    assert replica.delivered == list(range(15))
    assert replica.snapshots == []
    assert replica.state == master.state
    follower.stop()


@pytest.mark.timeout(30)
async def test_follower_that_lost_the_last_events_fetches_them_when_told_the_head(cluster: Cluster) -> None:
    """No later event reveals a lost tail: the master's heartbeat index does (Node._follow_tail_forever)."""
    master = await master_node(cluster)
    replica = Replica()
    follower = await follower_node(cluster, "f", replica)
    await follower.catch_up()
    follower.stop()  # what follows is lost to it, and nothing comes after
    master.emit(6)
    await follower.reach(2)
    assert replica.delivered == list(range(7)), "the whole tail, not only up to the head it was told"
    await follower.reach(3)
    assert replica.delivered == list(range(7)) and replica.state == master.state
    follower.stop()


@pytest.mark.timeout(30)
async def test_late_follower_catches_up_from_snapshot_and_range(cluster: Cluster) -> None:
    master = await master_node(cluster, history_size=10)
    master.emit(14)  # idx 0..14
    master.snapshot_state = master.state  # the snapshot lags at 14 ...
    master.emit(4)  # ... while history holds 9..19
    replica = Replica()
    follower = await follower_node(cluster, "late", replica)
    await follower.catch_up()
    assert replica.snapshots == [14]
    assert replica.delivered == [15, 16, 17, 18, 19]
    master.snapshot_state = None
    master.emit(2)  # live after catch-up
    await replica.reach(22)
    assert replica.delivered == list(range(15, 23))
    assert replica.state == master.state
    follower.stop()


@pytest.mark.timeout(30)
async def test_gap_older_than_history_falls_back_to_snapshot(cluster: Cluster) -> None:
    master = await master_node(cluster, history_size=5)
    master.emit(19)  # idx 0..19; history keeps 15..19
    replica = Replica()
    follower = await follower_node(cluster, "f", replica)
    await cluster.nodes[0].membership.wait_for(lambda alive: "f" in alive, 3.0)
    master.emit(0)  # idx 20 arrives live: the gap 0..19 is too old for the range
    await replica.reach(20)
    assert replica.snapshots and replica.snapshots[0] >= 19
    assert replica.state == master.state
    follower.stop()


@pytest.mark.timeout(30)
async def test_intake_deduplicates_local_events_and_forwards_commands(cluster: Cluster) -> None:
    got_events: list[tuple[str, int]] = []
    got_commands: list[ForwardedCommand] = []
    arrived = asyncio.Event()

    def on_local(ev: LocalEvent) -> None:
        got_events.append((ev.origin, ev.seq))
        arrived.set()

    def on_command(cmd: ForwardedCommand) -> None:
        got_commands.append(cmd)
        arrived.set()

    master_transport = cluster.transport()
    intake = Intake(master_transport, on_local, on_command)
    intake.start()  # declared before the token below, so a peer that sees the token can reach it
    Membership(master_transport, NodeId("m")).start()
    sender = cluster.node("w", elect=False)
    await sender.membership.wait_for(lambda alive: "m" in alive, 3.0)

    event = NodeTimedOut(node_id=NodeId("x"))
    for seq in (1, 1, 2, 1, 3):  # in order on one key; seq 3 marks the end
        send_local_event(sender.transport, LocalEvent(origin=NodeId("w"), seq=seq, event=event))
    command = DeleteInstance(command_id=CommandId("c1"), instance_id=InstanceId("i1"))
    send_command(sender.transport, NodeId("w"), command)
    async with asyncio.timeout(5.0):  # no order across the two keys: wait for both
        while not (got_commands and ("w", 3) in got_events):
            arrived.clear()
            await arrived.wait()
    assert got_events == [("w", 1), ("w", 2), ("w", 3)]
    assert got_commands == [ForwardedCommand(origin=NodeId("w"), command=command)]
    intake.stop()
    master_transport.close()


PEER_SCRIPT = """
import asyncio, sys
from skulk.cluster.membership import Membership
from skulk.cluster.transport import Transport, TransportSettings
from skulk.types.ids import NodeId

async def main() -> None:
    t = Transport(TransportSettings(cluster=sys.argv[1], listen=[sys.argv[2]], bootstrap_peers=[sys.argv[3]],
                                    multicast=False))
    t.open()
    Membership(t, NodeId("victim")).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.timeout(30)
async def test_killed_peer_leaves_membership_within_a_second(cluster: Cluster) -> None:
    watcher = cluster.node("watcher", elect=False)
    endpoint = f"tcp/127.0.0.1:{free_port()}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PEER_SCRIPT, cluster.name, endpoint, cluster.endpoints[0]
    )
    try:
        await watcher.membership.wait_for(lambda alive: "victim" in alive, 15.0)
        start = time.monotonic()
        proc.kill()  # SIGKILL: no goodbye, only the TCP link closing
        await watcher.membership.wait_for(lambda alive: "victim" not in alive, 1.0)
        print(f"kill -9 seen in {time.monotonic() - start:.3f}s")
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
