from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import TypeAdapter

from skulk.state.apply import FINISHED_TASKS_KEPT, apply
from skulk.types.events import (
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    NodeGatheredInfo,
    NodeTimedOut,
    RunnerStatusUpdated,
    TaskCreated,
    TaskFailed,
    TaskStatusUpdated,
    TopologyEdgeCreated,
)
from skulk.types.ids import NodeId, RunnerId, TaskId
from skulk.types.memory import Memory
from skulk.types.node_info import Connection, MemoryUsage, NodeIdentity, NodeInfo
from skulk.types.runners import RunnerReady
from skulk.types.state import State
from skulk.types.tasks import TaskStatus

from .factories import applied, chat_task, instance


def test_events_must_arrive_in_order() -> None:
    with pytest.raises(ValueError, match="applied to state"):
        apply(State(), IndexedEvent(idx=1, event=InstanceDeleted(instance_id="x")))


def test_apply_is_pure() -> None:
    """Every step of a history leaves the state it was given exactly as it was (a branch that wrote into a nested
    dict or list of the old state would show here), and the new state differs."""
    history: list = [
        InstanceCreated(instance=instance()),
        RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady()),
        TaskCreated(task=chat_task()),
        TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Running),
        TaskFailed(task_id=TaskId("t1"), error_message="boom"),
        InstanceDeleted(instance_id=instance().instance_id),
    ]
    state = State()
    for idx, event in enumerate(history):
        snapshot = state.model_dump(mode="json")
        after = apply(state, IndexedEvent(idx=idx, event=event))
        assert state.model_dump(mode="json") == snapshot, type(event).__name__
        assert after.model_dump(mode="json") != snapshot and after.last_event_applied_idx == idx
        state = after


def test_runner_status_only_for_runners_of_known_instances() -> None:
    ready = RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady())
    assert applied(ready).runners == {}
    state = applied(InstanceCreated(instance=instance()), ready)
    assert isinstance(state.runners[RunnerId("r-n1")], RunnerReady)


def test_deleting_an_instance_removes_its_runners() -> None:
    state = applied(
        InstanceCreated(instance=instance()),
        RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady()),
        InstanceDeleted(instance_id=instance().instance_id),
    )
    assert state.instances == {} and state.runners == {}


def test_finished_tasks_do_not_reopen_and_stay_bounded() -> None:
    state = applied(
        TaskCreated(task=chat_task()),
        TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Complete),
    )
    state = applied(TaskFailed(task_id=TaskId("t1"), error_message="late"), state=state)
    assert state.tasks[TaskId("t1")].task_status == TaskStatus.Complete
    for n in range(FINISHED_TASKS_KEPT + 10):
        state = applied(
            TaskCreated(task=chat_task(f"x{n}", command_id=f"c{n}")),
            TaskStatusUpdated(task_id=TaskId(f"x{n}"), task_status=TaskStatus.Complete),
            state=state,
        )
    assert len(state.tasks) == FINISHED_TASKS_KEPT
    assert TaskId(f"x{FINISHED_TASKS_KEPT + 9}") in state.tasks


def test_node_info_and_timeout() -> None:
    node = NodeId("n1")
    info = NodeInfo(
        identity=NodeIdentity(friendly_name="box"),
        memory=MemoryUsage(ram_total=Memory.from_gb(16), ram_available=Memory.from_gb(8)),
    )
    edge = Connection(source=node, sink=NodeId("n2"), sink_address="10.0.0.2")
    state = applied(
        NodeGatheredInfo(node_id=node, info=info, when=datetime.now(UTC)),
        NodeGatheredInfo(node_id=NodeId("n2"), info=info, when=datetime.now(UTC)),
        TopologyEdgeCreated(connection=edge),
    )
    assert state.node_memory[node].ram_available.in_gb == 8
    assert state.topology.nodes == [node, "n2"] and state.topology.connections == [edge]
    gone = applied(NodeTimedOut(node_id=node), state=state)
    assert node not in gone.node_memory and gone.topology.nodes == ["n2"] and gone.topology.connections == []


def test_an_edge_that_arrives_after_its_node_was_forgotten_is_dropped() -> None:
    """A peer probed the node just before it timed out (a restart in place gives it a new id): the late edge,
    either way, must not outlive the node, since no one would ever delete it (test_day_two's rejoin hung so)."""
    info = NodeInfo(identity=NodeIdentity(friendly_name="box"))
    a, b = NodeId("a"), NodeId("b")
    state = applied(*(NodeGatheredInfo(node_id=n, info=info, when=datetime.now(UTC)) for n in (a, b)))
    state = applied(NodeTimedOut(node_id=b), state=state)
    late = [Connection(source=a, sink=b, sink_address="127.0.0.1"), Connection(source=b, sink=a, sink_address="x")]
    assert applied(*(TopologyEdgeCreated(connection=c) for c in late), state=state).topology.connections == []


def test_state_round_trips_through_wire_json_in_skulk_shape() -> None:
    state = applied(
        InstanceCreated(instance=instance()),
        RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady()),
        TaskCreated(task=chat_task()),
    )
    wire = state.model_dump(mode="json")
    shard = wire["instances"]["inst"]["MlxRingInstance"]["shardAssignments"]["runnerToShard"]["r-n1"]
    assert shard["PipelineShardMetadata"]["startLayer"] == 0
    assert wire["runners"]["r-n1"] == {"RunnerReady": {}}
    assert "ChatCompletion" in wire["tasks"]["t1"]
    assert State.model_validate(wire) == state


def test_events_accept_snake_case_input() -> None:
    event = TypeAdapter(IndexedEvent).validate_python(
        {"idx": 0, "event": {"TaskStatusUpdated": {"task_id": "t", "task_status": "Running"}}}
    )
    assert event.event == TaskStatusUpdated(task_id=TaskId("t"), task_status=TaskStatus.Running)
