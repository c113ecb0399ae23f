from __future__ import annotations

from skulk.types.events import InstanceCreated, RunnerStatusUpdated, TaskCreated, TaskStatusUpdated
from skulk.types.ids import NodeId, RunnerId, TaskId
from skulk.types.runners import RunnerLoading, RunnerReady
from skulk.types.tasks import TaskStatus
from skulk.worker.plan import CancelRunnerTask, LocalRunner, SendTask, StartRunner, StopRunner, plan

from .factories import applied, chat_task, instance


def test_starts_only_this_nodes_runner() -> None:
    state = applied(InstanceCreated(instance=instance("a", ("n1", "n2"))))
    actions = plan(state, NodeId("n2"), {})
    assert actions == [StartRunner(state.instances["a"], RunnerId("r-n2"))]


def test_stops_runners_whose_instance_is_gone() -> None:
    assert plan(applied(), NodeId("n1"), {RunnerId("old"): LocalRunner(RunnerId("old"))}) == [
        StopRunner(RunnerId("old"))
    ]


def test_tasks_wait_until_every_rank_serves() -> None:
    state = applied(
        InstanceCreated(instance=instance("a", ("n1", "n2"))),
        RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady()),
        RunnerStatusUpdated(runner_id=RunnerId("r-n2"), runner_status=RunnerLoading()),
        TaskCreated(task=chat_task("t1", "a")),
    )
    local = {RunnerId("r-n1"): LocalRunner(RunnerId("r-n1"))}
    assert plan(state, NodeId("n1"), local) == []
    state = applied(RunnerStatusUpdated(runner_id=RunnerId("r-n2"), runner_status=RunnerReady()), state=state)
    assert plan(state, NodeId("n1"), local) == [SendTask(RunnerId("r-n1"), state.tasks[TaskId("t1")])]
    sent = {RunnerId("r-n1"): LocalRunner(RunnerId("r-n1"), sent=frozenset({TaskId("t1")}))}
    assert plan(state, NodeId("n1"), sent) == []


def test_cancelled_task_in_progress_is_cancelled_on_the_runner() -> None:
    state = applied(
        InstanceCreated(instance=instance()),
        TaskCreated(task=chat_task()),
        TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Cancelled),
    )
    local = {
        RunnerId("r-n1"): LocalRunner(RunnerId("r-n1"), frozenset({TaskId("t1")}), frozenset({TaskId("t1")}))
    }
    assert plan(state, NodeId("n1"), local) == [CancelRunnerTask(RunnerId("r-n1"), TaskId("t1"))]


def test_a_task_another_rank_completed_is_not_cancelled_here() -> None:
    """The sampling rank reports Complete before rank 0 lets go of the task at its next step header; a cancel
    in between made rank 0 record the finished request as cancelled."""
    state = applied(
        InstanceCreated(instance=instance()),
        TaskCreated(task=chat_task()),
        TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Complete),
    )
    local = {
        RunnerId("r-n1"): LocalRunner(RunnerId("r-n1"), frozenset({TaskId("t1")}), frozenset({TaskId("t1")}))
    }
    assert plan(state, NodeId("n1"), local) == []
