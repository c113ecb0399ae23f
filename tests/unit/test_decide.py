from __future__ import annotations

from skulk.master.decide import (
    events_for_command,
    events_for_lost_node,
    events_for_new_session,
    events_for_unhealthy_instances,
    pick_instance,
)
from skulk.types.commands import CancelCommand, DeleteInstance, StartChatCompletion
from skulk.types.events import (
    InstanceCreated,
    InstanceDeleted,
    InstanceRetrying,
    RunnerStatusUpdated,
    SessionStarted,
    TaskCreated,
    TaskFailed,
    TaskStatusUpdated,
)
from skulk.types.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from skulk.types.runners import RunnerFailed, RunnerReady
from skulk.types.tasks import TaskStatus

from .factories import CARD, applied, chat_task, instance


def _start(command_id: str = "c9") -> StartChatCompletion:
    return StartChatCompletion(
        command_id=CommandId(command_id),
        model=CARD.model_id,
    )


def test_chat_without_instance_fails_retryably() -> None:
    events = events_for_command(applied(), _start(), TaskId("t"))
    assert isinstance(events[0], TaskCreated) and isinstance(events[1], TaskFailed)
    assert "No instance found for model test/model" in events[1].error_message


def test_chat_goes_to_the_least_loaded_serving_instance() -> None:
    state = applied(
        InstanceCreated(instance=instance("a", ("n1",))),
        InstanceCreated(instance=instance("b", ("n2",))),
        RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady()),
        RunnerStatusUpdated(runner_id=RunnerId("r-n2"), runner_status=RunnerReady()),
        TaskCreated(task=chat_task("t1", "a")),
    )
    assert pick_instance(state, ModelId("test/model")) == InstanceId("b")
    (created,) = events_for_command(state, _start(), TaskId("t2"))
    assert isinstance(created, TaskCreated) and created.task.instance_id == "b"


def test_delete_instance_fails_its_open_tasks_first() -> None:
    state = applied(InstanceCreated(instance=instance()), TaskCreated(task=chat_task()))
    events = events_for_command(
        state, DeleteInstance(command_id=CommandId("c"), instance_id=InstanceId("inst")), TaskId("x")
    )
    assert isinstance(events[0], TaskFailed) and events[0].retryable
    assert isinstance(events[1], InstanceDeleted)


def test_cancel_targets_the_command_task() -> None:
    state = applied(InstanceCreated(instance=instance()), TaskCreated(task=chat_task(command_id="c1")))
    events = events_for_command(
        state, CancelCommand(command_id=CommandId("z"), target_command_id=CommandId("c1")), TaskId("x")
    )
    assert events == [TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Cancelled)]


def test_lost_node_fails_tasks_and_removes_its_instances() -> None:
    state = applied(
        InstanceCreated(instance=instance("a", ("n1", "n2"))),
        InstanceCreated(instance=instance("b", ("n3",))),
        TaskCreated(task=chat_task("t1", "a")),
        TaskCreated(task=chat_task("t2", "b", "c2")),
    )
    events = events_for_lost_node(state, NodeId("n2"))
    failed = [e for e in events if isinstance(e, TaskFailed)]
    assert [f.task_id for f in failed] == ["t1"] and "n2 left the cluster" in failed[0].error_message
    assert [e for e in events if isinstance(e, InstanceDeleted)] == [
        InstanceDeleted(instance_id=InstanceId("a"), failure_error="node n2 left the cluster")
    ]


def test_new_session_fails_every_open_task() -> None:
    state = applied(InstanceCreated(instance=instance()), TaskCreated(task=chat_task()))
    events = events_for_new_session(state, NodeId("m"), 3)
    assert events[0] == SessionStarted(master_node_id=NodeId("m"), term=3)
    assert isinstance(events[1], TaskFailed) and "session changed" in events[1].error_message


def test_failed_rank_retries_the_multi_rank_instance_only() -> None:
    """A single-rank runner restarts under its supervisor; a multi-rank instance restarts as a whole."""
    state = applied(
        InstanceCreated(instance=instance("a", ("n1", "n2"))),
        InstanceCreated(instance=instance("b", ("n3",))),
        RunnerStatusUpdated(runner_id=RunnerId("r-n2"), runner_status=RunnerFailed(error_message="x")),
        RunnerStatusUpdated(runner_id=RunnerId("r-n3"), runner_status=RunnerFailed(error_message="x")),
    )
    retry = InstanceRetrying(instance_id=InstanceId("a"), failure_error="n2: x")  # named by its node
    assert events_for_unhealthy_instances(state) == [retry]
