"""MetaInstances (seed 003): apply rules, the master's reconcilers and its command decisions, as pure functions."""

from __future__ import annotations

import itertools
import json

import pytest
from pydantic import ValidationError

from skulk.master import commands, reconcile
from skulk.master.reconcile import Ids
from skulk.types.commands import CreateInstance, DeleteMetaInstance, PlaceInstance
from skulk.types.events import (
    Event,
    InstanceCreated,
    InstanceDeleted,
    InstanceRetrying,
    LocalEvent,
    MetaInstanceCreated,
    MetaInstanceDeleted,
    MetaInstancePlacementFailed,
    NodeGatheredInfo,
    RunnerStatusUpdated,
    TaskCreated,
    TaskStatusUpdated,
    TopologyEdgeDeleted,
)
from skulk.types.ids import CommandId, InstanceId, MetaInstanceId, ModelId, NodeId, RunnerId
from skulk.types.instances import MlxRingInstance
from skulk.types.memory import Memory
from skulk.types.meta_instances import MetaInstance
from skulk.types.models import ModelCard
from skulk.types.node_info import Connection, MemoryUsage, NodeInfo, Topology
from skulk.types.runners import RunnerFailed, RunnerReady, RunnerShutdown
from skulk.types.state import State
from skulk.types.tasks import TaskStatus

from .factories import CARD, applied, chat_task, instance

M1, M2 = MetaInstanceId("m1"), MetaInstanceId("m2")
GB = 1 << 30


def meta(mid: MetaInstanceId = M1, **fields: object) -> MetaInstance:
    return MetaInstance(meta_instance_id=mid, model_id=CARD.model_id, **fields)  # type: ignore[arg-type]


def bound(instance_id: str = "inst", nodes: tuple[str, ...] = ("n1",), mid: MetaInstanceId = M1) -> MlxRingInstance:
    return instance(instance_id, nodes).model_copy(update={"meta_instance_id": mid})


def cluster(nodes: tuple[str, ...] = ("n1", "n2", "n3"), free_gb: float = 8) -> State:
    names = [NodeId(n) for n in nodes]
    return State(
        topology=Topology(
            nodes=names,
            connections=[
                Connection(source=a, sink=b, sink_address=f"10.0.0.{i}")
                for i, (a, b) in enumerate(itertools.permutations(names, 2))
            ],
        ),
        node_memory={
            n: MemoryUsage(ram_total=Memory.from_gb(2 * free_gb), ram_available=Memory.from_gb(free_gb))
            for n in names
        },
    )


def ids() -> Ids:
    counter = itertools.count()
    return Ids(
        instance=lambda: InstanceId(f"i{next(counter)}"),
        runner=lambda: RunnerId(f"r{next(counter)}"),
        port=lambda: 29500,
    )


def cards(model_id: ModelId) -> ModelCard | None:
    return CARD if model_id == CARD.model_id else None


# ------------------------------------------------------------------------------------------ types


def test_meta_instance_is_frozen_and_has_the_seed_defaults() -> None:
    m = meta()
    assert (m.sharding.value, m.instance_meta.value, m.min_nodes, m.node_ids) == ("Pipeline", "MlxRing", 1, None)
    assert (m.placement_error, m.consecutive_failures, m.last_failure_error) == (None, 0, None)
    with pytest.raises(ValidationError):
        m.min_nodes = 2  # type: ignore[misc]


def test_state_and_instances_without_the_new_fields_still_load() -> None:
    old = json.loads(applied(InstanceCreated(instance=instance())).model_dump_json())
    old.pop("metaInstances")
    for inst in old["instances"].values():
        inst["MlxRingInstance"].pop("metaInstanceId")
    state = State.model_validate(old)
    assert state.meta_instances == {} and state.instances[InstanceId("inst")].meta_instance_id is None


def test_state_with_meta_instances_round_trips() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()), InstanceCreated(instance=bound()))
    assert State.model_validate_json(state.model_dump_json()) == state


# ------------------------------------------------------------------------------------------ apply


def test_lifecycle_create_then_delete() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()))
    assert state.meta_instances[M1] == meta()
    state = applied(MetaInstanceDeleted(meta_instance_id=M1), state=state)
    assert state.meta_instances == {}
    assert applied(MetaInstanceDeleted(meta_instance_id=M1), state=state).meta_instances == {}


def test_retry_counter_through_a_cycle_and_reset_on_a_new_instance() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()), InstanceCreated(instance=bound()))
    state = applied(InstanceRetrying(instance_id=InstanceId("inst"), meta_instance_id=M1, failure_error="oom"),
                    state=state)
    assert (state.meta_instances[M1].consecutive_failures, state.meta_instances[M1].last_failure_error) == (1, "oom")
    assert InstanceId("inst") in state.instances  # retrying keeps the instance
    state = applied(InstanceDeleted(instance_id=InstanceId("inst"), failure_error="crash"), state=state)
    assert (state.meta_instances[M1].consecutive_failures, state.meta_instances[M1].last_failure_error) == (2, "crash")
    state = applied(InstanceCreated(instance=bound("inst2")), state=state)
    again = state.meta_instances[M1]
    assert (again.consecutive_failures, again.placement_error, again.last_failure_error) == (0, None, "crash")


def test_retrying_a_missing_instance_is_a_no_op() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()))
    after = applied(InstanceRetrying(instance_id=InstanceId("gone"), meta_instance_id=M1, failure_error="x"),
                    state=state)
    assert after.meta_instances == state.meta_instances


def test_deleting_without_a_failure_does_not_count() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()), InstanceCreated(instance=bound()),
                    InstanceDeleted(instance_id=InstanceId("inst")))
    assert state.meta_instances[M1].consecutive_failures == 0


def test_placement_failure_is_recorded_and_cleared_by_a_placement() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()),
                    MetaInstancePlacementFailed(meta_instance_id=M1, reason="no room"))
    assert state.meta_instances[M1].placement_error == "no room"
    state = applied(InstanceCreated(instance=bound()), state=state)
    assert state.meta_instances[M1].placement_error is None


# --------------------------------------------------------------------------------------- matching


def test_constraint_matching_model_min_nodes_and_node_ids() -> None:
    two = bound("i", ("n1", "n2"))
    assert reconcile.matches(meta(min_nodes=2), two)
    assert not reconcile.matches(meta(min_nodes=3), two)
    assert reconcile.matches(meta(node_ids=[NodeId("n1"), NodeId("n2"), NodeId("n3")]), two)
    assert not reconcile.matches(meta(node_ids=[NodeId("n1")]), two)
    assert not reconcile.matches(meta(sharding="Tensor"), two)  # type: ignore[arg-type]


def test_connection_health_single_and_multi_node_and_edge_removal() -> None:
    state = cluster()
    assert reconcile.connections_healthy(state, bound("i", ("n1",)))
    assert reconcile.connections_healthy(state, bound("i", ("n1", "n2")))
    one_way = [c for c in state.topology.connections if (c.source, c.sink) != ("n1", "n2")]
    state = state.model_copy(update={"topology": state.topology.model_copy(update={"connections": one_way})})
    assert reconcile.connections_healthy(state, bound("i", ("n1", "n2")))  # one direction still links them
    none = [c for c in one_way if (c.source, c.sink) != ("n2", "n1")]
    state = state.model_copy(update={"topology": state.topology.model_copy(update={"connections": none})})
    assert not reconcile.connections_healthy(state, bound("i", ("n1", "n2")))
    gone = cluster(("n2", "n3"))
    assert not reconcile.connections_healthy(gone, bound("i", ("n1",)))


def test_unsatisfied_detection_and_exclusive_binding() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta(M1)), MetaInstanceCreated(meta_instance=meta(M2)),
                    state=cluster())
    assert [m.meta_instance_id for m in reconcile.unsatisfied(state)] == [M1, M2]
    state = applied(InstanceCreated(instance=bound("a", mid=M1)), state=state)
    assert [m.meta_instance_id for m in reconcile.unsatisfied(state)] == [M2]  # a serves M1 only
    state = applied(InstanceCreated(instance=instance("direct")), state=state)
    assert [m.meta_instance_id for m in reconcile.unsatisfied(state)] == [M2]  # a direct one binds nobody


# ------------------------------------------------------------------------------------------ health


def test_runner_states_still_starting_failed_and_shut_down() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()), InstanceCreated(instance=bound("i", ("n1", "n2"))),
                    state=cluster())
    assert reconcile.runners_failed(state, state.instances[InstanceId("i")]) is None  # no status yet
    state = applied(RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerFailed(error_message="oom")),
                    state=state)
    assert reconcile.runners_failed(state, state.instances[InstanceId("i")]) is None  # n2 has not ended
    state = applied(RunnerStatusUpdated(runner_id=RunnerId("r-n2"), runner_status=RunnerShutdown()), state=state)
    assert reconcile.runners_failed(state, state.instances[InstanceId("i")]) == "n1: oom"


def _failing(failures: int) -> State:
    state = applied(MetaInstanceCreated(meta_instance=meta(consecutive_failures=failures)),
                    InstanceCreated(instance=bound()), TaskCreated(task=chat_task()), state=cluster())
    state = state.model_copy(update={"meta_instances": {M1: meta(consecutive_failures=failures)}})
    return applied(RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerFailed(error_message="boom")),
                   state=state)


def test_failed_instance_is_retried_until_the_limit_then_deleted() -> None:
    events = reconcile.instance_health(_failing(2))
    assert [type(e).__name__ for e in events] == ["TaskFailed", "InstanceRetrying"]
    events = reconcile.instance_health(_failing(3))
    assert events[-1] == InstanceDeleted(instance_id=InstanceId("inst"), failure_error="n1: boom")


def test_max_retries_then_deletion_then_a_new_placement() -> None:
    state = _failing(0)
    for attempt in range(1, 4):
        state = applied(*reconcile.instance_health(state), state=state)
        # the runner restarted for this attempt fails again (failures of older attempts are stale)
        failed = RunnerFailed(error_message="boom", attempt=attempt)
        state = applied(RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=failed), state=state)
    assert state.meta_instances[M1].consecutive_failures == 3
    state = applied(*reconcile.instance_health(state), state=state)
    assert InstanceId("inst") not in state.instances and state.meta_instances[M1].consecutive_failures == 4
    placed = reconcile.unsatisfied_placements(state, cards, ids())
    assert isinstance(placed[0], InstanceCreated) and placed[0].instance.meta_instance_id == M1


def test_broken_link_deletes_the_instance_with_network_connection_lost() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()), InstanceCreated(instance=bound("i", ("n1", "n2"))),
                    state=cluster(("n1", "n2")))
    for c in list(state.topology.connections):
        state = applied(TopologyEdgeDeleted(connection=c), state=state)
    assert reconcile.instance_health(state) == [InstanceDeleted(instance_id=InstanceId("i"),
                                                                failure_error="Network connection lost")]


def test_health_ignores_directly_placed_instances_and_is_idempotent() -> None:
    state = applied(InstanceCreated(instance=instance()), state=cluster())
    state = applied(RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerFailed()), state=state)
    assert reconcile.instance_health(state) == []
    healthy = applied(MetaInstanceCreated(meta_instance=meta()), InstanceCreated(instance=bound("b")),
                      RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady()), state=cluster())
    assert reconcile.instance_health(healthy) == reconcile.instance_health(healthy) == []


# --------------------------------------------------------------------------------------- placement


def test_two_meta_instances_in_one_pass_do_not_take_the_same_memory() -> None:
    """Each node fits one copy of the model, not two: the second placement must go elsewhere."""
    state = applied(MetaInstanceCreated(meta_instance=meta(M1)), MetaInstanceCreated(meta_instance=meta(M2)),
                    state=cluster(("n1", "n2"), free_gb=2.2))
    events = reconcile.unsatisfied_placements(state, cards, ids())
    created = [e.instance for e in events if isinstance(e, InstanceCreated)]
    assert len(created) == 2
    assert {n for i in created for n in i.shard_assignments.node_to_runner} == {"n1", "n2"}


def test_node_ids_intersect_live_nodes_so_a_dead_pinned_node_does_not_block() -> None:
    pinned = meta(node_ids=[NodeId("n1"), NodeId("dead")])
    state = applied(MetaInstanceCreated(meta_instance=pinned), state=cluster())
    events = reconcile.unsatisfied_placements(state, cards, ids())
    assert isinstance(events[0], InstanceCreated)
    assert set(events[0].instance.shard_assignments.node_to_runner) == {"n1"}


def test_placement_failure_is_emitted_only_when_the_reason_changes() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta(min_nodes=4)), state=cluster())
    first = reconcile.unsatisfied_placements(state, cards, ids())
    assert len(first) == 1 and isinstance(first[0], MetaInstancePlacementFailed)
    state = applied(*first, state=state)
    assert reconcile.unsatisfied_placements(state, cards, ids()) == []
    unknown = applied(MetaInstanceCreated(meta_instance=MetaInstance(meta_instance_id=M2, model_id=ModelId("x/y"))),
                      state=cluster())
    failed = reconcile.unsatisfied_placements(unknown, cards, ids())
    assert isinstance(failed[0], MetaInstancePlacementFailed) and "unknown model" in failed[0].reason


def test_several_meta_instances_for_one_model_and_deleting_one_leaves_the_others() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta(M1)), MetaInstanceCreated(meta_instance=meta(M2)),
                    state=cluster())
    state = applied(*reconcile.unsatisfied_placements(state, cards, ids()), state=state)
    assert len(state.instances) == 2
    state = applied(*commands.delete_meta_instance(state, DeleteMetaInstance(command_id=CommandId("c"),
                                                                             meta_instance_id=M1)), state=state)
    assert list(state.meta_instances) == [M2]
    assert [i.meta_instance_id for i in state.instances.values()] == [M2]


# ---------------------------------------------------------------------------------------- commands


def test_cascade_cancels_pending_and_running_tasks_and_skips_finished_ones() -> None:
    state = applied(MetaInstanceCreated(meta_instance=meta()), InstanceCreated(instance=bound()),
                    TaskCreated(task=chat_task("t1")), TaskCreated(task=chat_task("t2", command_id="c2")),
                    TaskCreated(task=chat_task("t3", command_id="c3")),
                    TaskStatusUpdated(task_id=chat_task("t2").task_id, task_status=TaskStatus.Running),
                    TaskStatusUpdated(task_id=chat_task("t3").task_id, task_status=TaskStatus.Complete))
    events = commands.delete_meta_instance(state, DeleteMetaInstance(command_id=CommandId("c"), meta_instance_id=M1))
    expected: list[Event] = [
        TaskStatusUpdated(task_id=chat_task("t1").task_id, task_status=TaskStatus.Cancelled),
        TaskStatusUpdated(task_id=chat_task("t2").task_id, task_status=TaskStatus.Cancelled),
        InstanceDeleted(instance_id=InstanceId("inst")),
        MetaInstanceDeleted(meta_instance_id=M1),
    ]
    assert events == expected
    assert commands.delete_meta_instance(applied(*events, state=state), DeleteMetaInstance(
        command_id=CommandId("c"), meta_instance_id=M1)) == []  # double delete: idempotent


def test_concurrent_place_commands_cannot_double_book_a_node() -> None:
    """Each node fits one copy: the second PlaceInstance is refused with the memory arithmetic."""
    state = cluster(("n1",), free_gb=2.2)

    def command(name: str) -> PlaceInstance:
        return PlaceInstance(command_id=CommandId(name), instance_id=InstanceId(name), model_id=CARD.model_id)

    state = applied(*commands.place_instance(state, command("a"), cards, ids()), state=state)
    with pytest.raises(commands.Refused) as refused:
        commands.place_instance(state, command("b"), cards, ids())
    assert refused.value.code == "InsufficientMemory" and "GB" in refused.value.message


def test_create_instance_with_colliding_ids_is_refused() -> None:
    state = applied(InstanceCreated(instance=instance("a")))
    with pytest.raises(commands.Refused):
        commands.create_instance(state, CreateInstance(command_id=CommandId("c"), instance=instance("a")))
    with pytest.raises(commands.Refused, match="runner ids"):
        commands.create_instance(state, CreateInstance(command_id=CommandId("c"), instance=instance("b")))


def test_workers_may_report_only_about_themselves() -> None:
    state = applied(InstanceCreated(instance=instance("a", ("n1",))), TaskCreated(task=chat_task("t1", "a")))
    own = RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady())
    assert commands.accepts_local(state, LocalEvent(origin=NodeId("n1"), seq=1, event=own))
    assert not commands.accepts_local(state, LocalEvent(origin=NodeId("n2"), seq=1, event=own))
    cancel = TaskStatusUpdated(task_id=chat_task().task_id, task_status=TaskStatus.Cancelled)
    assert not commands.accepts_local(state, LocalEvent(origin=NodeId("n2"), seq=2, event=cancel))
    info = NodeGatheredInfo(node_id=NodeId("n1"), info=NodeInfo(), when="2026-01-01T00:00:00Z")  # type: ignore[arg-type]
    assert not commands.accepts_local(state, LocalEvent(origin=NodeId("n2"), seq=3, event=info))
    forged = InstanceDeleted(instance_id=InstanceId("a"))
    assert not commands.accepts_local(state, LocalEvent(origin=NodeId("n1"), seq=4, event=forged))


# -------------------------------------------------------------------------------------- diagnostics


def test_status_words_placing_error_retrying_healthy() -> None:
    from skulk.diagnostics.cli import meta_table
    from skulk.diagnostics.meta import meta_status

    state = applied(MetaInstanceCreated(meta_instance=meta()), state=cluster())
    assert meta_status(state, state.meta_instances[M1]) == "placing"
    failed = applied(MetaInstancePlacementFailed(meta_instance_id=M1, reason="no room"), state=state)
    assert meta_status(failed, failed.meta_instances[M1]) == "error: no room"
    state = applied(InstanceCreated(instance=bound()),
                    RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady()), state=state)
    assert meta_status(state, state.meta_instances[M1]) == "healthy"
    state = applied(InstanceRetrying(instance_id=InstanceId("inst"), meta_instance_id=M1, failure_error="oom"),
                    state=state)
    assert meta_status(state, state.meta_instances[M1]) == "RETRYING (1/3): oom"
    table = meta_table({"meta_instances": {M1: {"modelId": "m", "status": "RETRYING (1/3): oom"}}})
    assert table is not None and table.row_count == 1
    assert meta_table({"meta_instances": {}}) is None


# ------------------------------------------------------------------------------- cluster-wide cards


def test_a_card_added_on_one_node_reaches_every_state_once() -> None:
    from skulk.master.decide import events_for_command
    from skulk.types.commands import AddModelCard
    from skulk.types.events import ModelCardAdded, NodeTimedOut
    from skulk.types.ids import TaskId

    custom = CARD.model_copy(update={"model_id": ModelId("org/custom")})
    add = AddModelCard(command_id=CommandId("c"), card=custom)
    events = events_for_command(State(), add, TaskId("t"))
    assert events == [ModelCardAdded(card=custom)]
    state = applied(*events)
    assert state.model_cards == {ModelId("org/custom"): custom}
    assert events_for_command(state, add, TaskId("t")) == []  # the same card again changes nothing
    gone = applied(NodeTimedOut(node_id=NodeId("n1")), state=state.model_copy(update={"downloads": {"n1": {}}}))
    assert gone.downloads == {} and gone.model_cards == state.model_cards
