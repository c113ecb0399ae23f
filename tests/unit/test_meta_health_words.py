"""Seed 003 rows of issue 29: a MetaInstance's failure message names node and cause, "re-created" only when the
instance really was re-created, and connection health per IP edge (swapped cables show)."""

from __future__ import annotations

import signal

from skulk.diagnostics.meta import meta_status
from skulk.master import decide, reconcile
from skulk.types.events import (
    InstanceCreated,
    InstanceDeleted,
    InstanceRetrying,
    MetaInstanceCreated,
    RunnerStatusUpdated,
    TopologyEdgeCreated,
    TopologyEdgeDeleted,
)
from skulk.types.ids import InstanceId, MetaInstanceId, NodeId, RunnerId
from skulk.types.instances import Rendezvous
from skulk.types.meta_instances import MetaInstance
from skulk.types.node_info import Connection, NodeIdentity, Topology
from skulk.types.runners import RunnerFailed, RunnerReady
from skulk.types.state import State
from skulk.worker.supervisor import exit_cause

from .factories import CARD, applied, instance

M1 = MetaInstanceId("m1")
N1, N2 = NodeId("n1"), NodeId("n2")


def two_nodes() -> State:
    return State(
        topology=Topology(nodes=[N1, N2], connections=[
            Connection(source=N2, sink=N1, sink_address="10.0.0.1"),
            Connection(source=N1, sink=N2, sink_address="10.0.0.2"),
        ]),
        node_identities={N1: NodeIdentity(friendly_name="MacBook Pro"), N2: NodeIdentity(friendly_name="Mac Studio")},
    )


def bound_pair() -> State:
    placed = instance("i", ("n1", "n2")).model_copy(
        update={"meta_instance_id": M1, "rendezvous": Rendezvous(host="10.0.0.1", port=29500)})
    meta = MetaInstance(meta_instance_id=M1, model_id=CARD.model_id, min_nodes=2)
    return applied(MetaInstanceCreated(meta_instance=meta), InstanceCreated(instance=placed), state=two_nodes())


def failed(state: State, runner: str, why: str, attempt: int = 0) -> State:
    status = RunnerFailed(error_message=why, attempt=attempt)
    return applied(RunnerStatusUpdated(runner_id=RunnerId(runner), runner_status=status), state=state)


def ready(state: State) -> State:
    ok = [RunnerStatusUpdated(runner_id=RunnerId(r), runner_status=RunnerReady()) for r in ("r-n1", "r-n2")]
    return applied(*ok, state=state)


def test_the_failure_message_names_each_node_and_its_cause_in_rank_order() -> None:
    state = failed(failed(bound_pair(), "r-n2", "connection reset"), "r-n1", "OOM")
    events = reconcile.instance_health(state)
    retry = next(e for e in events if isinstance(e, InstanceRetrying))
    assert retry.failure_error == "MacBook Pro: OOM; Mac Studio: connection reset"
    after = applied(*events, state=state)
    assert meta_status(after, after.meta_instances[M1]) == (
        "RETRYING (1/3): MacBook Pro: OOM; Mac Studio: connection reset")


def test_a_node_without_a_friendly_name_is_named_by_its_id() -> None:
    state = bound_pair().model_copy(update={"node_identities": {}})
    state = failed(failed(state, "r-n1", "boom"), "r-n2", "boom too")
    assert reconcile.runners_failed(state, state.instances[InstanceId("i")]) == "n1: boom; n2: boom too"


def test_a_directly_placed_instance_names_its_failed_node_too() -> None:
    placed = instance("d", ("n1", "n2"))
    state = failed(applied(InstanceCreated(instance=placed), state=two_nodes()), "r-n2", "connection reset")
    (retry,) = [e for e in decide.events_for_unhealthy_instances(state) if isinstance(e, InstanceRetrying)]
    assert retry.failure_error == "Mac Studio: connection reset"


def test_exit_causes_read_as_causes() -> None:
    assert exit_cause(-signal.SIGKILL, oom=False).startswith("killed by signal 9 (SIGKILL) from outside")
    assert exit_cause(-signal.SIGKILL, oom=True).startswith("OOM")
    assert exit_cause(-signal.SIGSEGV) == "runner process killed by SIGSEGV"
    assert exit_cause(1, "FileNotFoundError('config.json')") == "runner crashed: FileNotFoundError('config.json')"
    assert exit_cause(1, "OutOfMemoryError('CUDA')").startswith("OOM")
    assert exit_cause(3) == "runner process exited with code 3"


def test_an_in_place_retry_that_recovers_is_not_called_a_re_creation() -> None:
    state = ready(bound_pair())
    assert meta_status(state, state.meta_instances[M1]) == "healthy"
    state = failed(failed(state, "r-n1", "OOM"), "r-n2", "connection reset")
    state = applied(*reconcile.instance_health(state), state=state)
    assert InstanceId("i") in state.instances  # retried in place: the same instance
    status = meta_status(ready(state), state.meta_instances[M1])
    assert "re-created" not in status
    assert status == "healthy (recovered in place after retry 1/3: MacBook Pro: OOM; Mac Studio: connection reset)"


def test_healthy_after_a_real_re_creation_says_so() -> None:
    state = ready(bound_pair())
    state = applied(InstanceDeleted(instance_id=InstanceId("i"), failure_error="MacBook Pro: OOM"), state=state)
    placed = instance("j", ("n1", "n2")).model_copy(update={"meta_instance_id": M1})
    state = ready(applied(InstanceCreated(instance=placed), state=state))
    assert meta_status(state, state.meta_instances[M1]) == "healthy (instance re-created due to failure)"


def test_swapped_cables_break_the_instance_though_the_pair_stays_linked() -> None:
    """n2 reached n1 at 10.0.0.1 (the rendezvous); after the swap it reaches n1 at 10.0.1.1 only."""
    state = ready(bound_pair())
    assert reconcile.instance_health(state) == []
    old = Connection(source=N2, sink=N1, sink_address="10.0.0.1")
    new = Connection(source=N2, sink=N1, sink_address="10.0.1.1")
    state = applied(TopologyEdgeDeleted(connection=old), TopologyEdgeCreated(connection=new), state=state)
    assert reconcile.instance_health(state) == [
        InstanceDeleted(instance_id=InstanceId("i"), failure_error=reconcile.CONNECTION_LOST)]
    assert [m.meta_instance_id for m in reconcile.unsatisfied(state)] == [M1]


def test_the_rendezvous_edge_from_any_rank_keeps_the_instance_healthy() -> None:
    """Only the edge into rank 0 at the rendezvous address matters; an unrelated edge changing does not."""
    state = ready(bound_pair())
    other = Connection(source=N1, sink=N2, sink_address="10.0.0.2")
    moved = Connection(source=N1, sink=N2, sink_address="10.0.1.2")
    state = applied(TopologyEdgeDeleted(connection=other), TopologyEdgeCreated(connection=moved), state=state)
    assert reconcile.instance_health(state) == []


def test_a_meta_instance_created_before_any_node_reported_is_placing_not_an_error() -> None:
    """At first start the default model's MetaInstance is created before the node's own info arrives: that is
    no failure (no WARNING "cannot be placed: … 0 of 0 available node(s)" a second before it places)."""
    meta = MetaInstance(meta_instance_id=M1, model_id=CARD.model_id)
    empty = applied(MetaInstanceCreated(meta_instance=meta))
    assert reconcile.unsatisfied_placements(empty, lambda _m: CARD, reconcile.Ids()) == []
    assert meta_status(empty, empty.meta_instances[M1]) == "placing"
    pending = applied(MetaInstanceCreated(meta_instance=meta), state=State(topology=Topology(nodes=[N1])))
    assert reconcile.unsatisfied_placements(pending, lambda _m: CARD, reconcile.Ids()) == []  # memory not in yet
    too_few = applied(MetaInstanceCreated(meta_instance=meta.model_copy(update={"min_nodes": 3})),
                      state=two_nodes())
    (failed_event,) = reconcile.unsatisfied_placements(too_few, lambda _m: CARD, reconcile.Ids())
    assert "2 available node(s)" in failed_event.reason  # type: ignore[union-attr]


def test_a_launched_preview_is_placed_on_exactly_its_nodes() -> None:
    """The dashboard's Launch sends the preview's nodes as first_node_ids: the first instance goes there, not
    where the master's own choice (most headroom) would put it; nodes where it no longer fits give []."""
    from skulk.types.memory import Memory
    from skulk.types.node_info import MemoryUsage

    n3 = NodeId("n3")
    state = two_nodes()
    state = state.model_copy(update={
        "topology": Topology(nodes=[N1, N2, n3], connections=state.topology.connections),
        "node_memory": {n: MemoryUsage(ram_total=Memory.from_gb(16), ram_available=Memory.from_gb(free))
                        for n, free in ((N1, 8), (N2, 12), (n3, 4))}})
    meta = MetaInstance(meta_instance_id=M1, model_id=CARD.model_id)
    state = applied(MetaInstanceCreated(meta_instance=meta), state=state)
    (chosen,) = reconcile.unsatisfied_placements(state, lambda _m: CARD, reconcile.Ids())
    assert isinstance(chosen, InstanceCreated) and reconcile.nodes_of(chosen.instance) == {N2}  # most headroom
    (first,) = reconcile.first_placement(state, meta, [n3], lambda _m: CARD, reconcile.Ids())
    assert isinstance(first, InstanceCreated) and reconcile.nodes_of(first.instance) == {n3}
    assert first.instance.meta_instance_id == M1
    tight = state.model_copy(update={"node_memory": {**state.node_memory, n3: MemoryUsage(
        ram_total=Memory.from_gb(16), ram_available=Memory.from_bytes(1))}})
    assert reconcile.first_placement(tight, meta, [n3], lambda _m: CARD, reconcile.Ids()) == []
    pinned = meta.model_copy(update={"node_ids": [N1, N2]})
    assert reconcile.first_placement(state, pinned, [n3], lambda _m: CARD, reconcile.Ids()) == []
