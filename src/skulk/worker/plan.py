"""Pure planning: given the cluster state and what runs here, what should this node do next."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from skulk.state.queries import is_serving
from skulk.types.ids import NodeId, RunnerId, TaskId
from skulk.types.instances import MlxRingInstance
from skulk.types.state import State
from skulk.types.tasks import Task, TaskStatus


@dataclass(frozen=True)
class LocalRunner:
    """What the worker knows about one of its runners without asking the cluster."""

    runner_id: RunnerId
    sent: frozenset[TaskId] = frozenset()
    in_progress: frozenset[TaskId] = frozenset()
    attempt: int = 0


@dataclass(frozen=True)
class StartRunner:
    instance: MlxRingInstance
    runner_id: RunnerId
    attempt: int = 0


@dataclass(frozen=True)
class RestartRunner:
    """The instance retries as a whole: this rank, dead or alive in a dead group, stops and starts afresh."""

    instance: MlxRingInstance
    runner_id: RunnerId
    attempt: int
    why: str


@dataclass(frozen=True)
class StopRunner:
    runner_id: RunnerId


@dataclass(frozen=True)
class SendTask:
    runner_id: RunnerId
    task: Task


@dataclass(frozen=True)
class CancelRunnerTask:
    runner_id: RunnerId
    task_id: TaskId


Action = StartRunner | StopRunner | RestartRunner | SendTask | CancelRunnerTask


def plan(state: State, node_id: NodeId, local: Mapping[RunnerId, LocalRunner]) -> list[Action]:
    actions: list[Action] = []
    wanted: dict[RunnerId, MlxRingInstance] = {}
    for instance in state.instances.values():
        runner_id = instance.shard_assignments.node_to_runner.get(node_id)
        if runner_id is not None:
            wanted[runner_id] = instance
    actions += [StopRunner(r) for r in local if r not in wanted]
    for runner_id, instance in wanted.items():
        retries = state.instance_retries.get(instance.instance_id)
        attempt = retries.attempt if retries is not None else 0
        if runner_id not in local:
            actions.append(StartRunner(instance, runner_id, attempt))
        elif local[runner_id].attempt < attempt:
            why = (retries.last_error if retries is not None else None) or "a rank failed"
            actions.append(RestartRunner(instance, runner_id, attempt, why))
        else:
            actions += _task_actions(state, instance, local[runner_id])
    return actions


def _task_actions(state: State, instance: MlxRingInstance, runner: LocalRunner) -> list[Action]:
    """Open tasks go to every rank once the whole instance serves; cancelled or failed ones are cancelled
    where running. A complete one is not: the sampling rank finished it, and every other rank lets go of it
    at the next step header; a cancel racing that release made rank 0 record a finished request as
    cancelled (its flight recorder ended in `cancel_received`, `cancelled`)."""
    serving = is_serving(state, instance)
    actions: list[Action] = []
    for task in state.tasks.values():
        if task.instance_id != instance.instance_id:
            continue
        if task.task_status.is_open:
            if serving and task.task_id not in runner.sent:
                actions.append(SendTask(runner.runner_id, task))
        elif task.task_status is not TaskStatus.Complete and task.task_id in runner.in_progress:
            actions.append(CancelRunnerTask(runner.runner_id, task.task_id))
    return actions
