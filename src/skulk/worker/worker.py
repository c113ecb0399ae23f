"""The worker shell: after every state change, plan, then start/stop runners and route tasks to them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from skulk.runner.messages import TaskEnded
from skulk.runner.spec import RunnerSpec
from skulk.types.chunks import ErrorChunk, TokenChunk
from skulk.types.events import Event, RunnerStatusUpdated, TaskFailed, TaskStatusUpdated
from skulk.types.ids import NodeId, RunnerId, TaskId
from skulk.types.instances import MlxRingInstance
from skulk.types.runners import RunnerStatus
from skulk.types.state import State
from skulk.types.tasks import TaskStatus
from skulk.worker.plan import (
    Action,
    CancelRunnerTask,
    LocalRunner,
    SendTask,
    StartRunner,
    StopRunner,
    plan,
)
from skulk.worker.supervisor import RunnerSupervisor, SupervisorCallbacks

log = logging.getLogger("skulk.worker")

ModelDirFor = Callable[[MlxRingInstance], Path]


class Worker:
    def __init__(
        self,
        node_id: NodeId,
        *,
        emit: Callable[[Event], None],
        publish: Callable[[TokenChunk | ErrorChunk], None],
        model_dir_for: ModelDirFor,
        warmup_deadline_s: float,
        fault: str | None = None,
        record: bool = True,
    ) -> None:
        self.node_id = node_id
        self.emit = emit
        self.publish = publish
        self.model_dir_for = model_dir_for
        self.warmup_deadline_s = warmup_deadline_s
        self.fault = fault
        self.record = record
        self.supervisors: dict[RunnerId, RunnerSupervisor] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._closed = False

    def local_view(self) -> dict[RunnerId, LocalRunner]:
        return {
            rid: LocalRunner(rid, frozenset(s.view.sent), frozenset(s.view.in_progress))
            for rid, s in self.supervisors.items()
        }

    def reconcile(self, state: State) -> None:
        if self._closed:
            return
        for action in plan(state, self.node_id, self.local_view()):
            self._execute(action)
        for supervisor in self.supervisors.values():
            supervisor.forget_finished(state)

    def _execute(self, action: Action) -> None:
        match action:
            case StartRunner(instance=instance, runner_id=runner_id):
                self._start_runner(instance, runner_id)
            case StopRunner(runner_id=runner_id):
                supervisor = self.supervisors.pop(runner_id)
                task = asyncio.get_running_loop().create_task(supervisor.stop())
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
            case SendTask(runner_id=runner_id, task=task):
                self.supervisors[runner_id].send_task(task)
            case CancelRunnerTask(runner_id=runner_id, task_id=task_id):
                self.supervisors[runner_id].cancel(task_id)

    def _start_runner(self, instance: MlxRingInstance, runner_id: RunnerId) -> None:
        shard = instance.shard_assignments.runner_to_shard[runner_id]
        spec = RunnerSpec(
            node_id=self.node_id,
            runner_id=runner_id,
            instance_id=instance.instance_id,
            shard=shard,
            sharding=instance.sharding,
            model_dir=self.model_dir_for(instance),
            rendezvous=instance.rendezvous,
            warmup_deadline_s=self.warmup_deadline_s,
            fault=self.fault,
            record=self.record,
        )
        log.info(
            "starting runner %s for %s (rank %d/%d, layers %d-%d)",
            runner_id[:8],
            shard.model_card.model_id,
            shard.device_rank,
            shard.world_size,
            shard.start_layer,
            shard.end_layer,
        )
        supervisor = RunnerSupervisor(spec, self._callbacks(runner_id, is_sampler=shard.is_last))
        self.supervisors[runner_id] = supervisor
        supervisor.start()

    def _callbacks(self, runner_id: RunnerId, *, is_sampler: bool) -> SupervisorCallbacks:
        def on_status(status: RunnerStatus) -> None:
            self.emit(RunnerStatusUpdated(runner_id=runner_id, runner_status=status))

        def on_chunks(chunks: list[TokenChunk | ErrorChunk]) -> None:
            for chunk in chunks:
                self.publish(chunk)

        def on_task_started(task_id: TaskId) -> None:
            if is_sampler:
                self.emit(TaskStatusUpdated(task_id=task_id, task_status=TaskStatus.Running))

        def on_task_ended(ended: TaskEnded) -> None:
            if not is_sampler and ended.status != TaskStatus.Failed:
                return
            if ended.status == TaskStatus.Failed:
                message = ended.error or "runner failed"
                self.emit(TaskFailed(task_id=ended.task_id, error_message=message, retryable=ended.retryable))
            else:
                self.emit(TaskStatusUpdated(task_id=ended.task_id, task_status=ended.status))

        return SupervisorCallbacks(on_status, on_chunks, on_task_started, on_task_ended)

    async def stop(self) -> None:
        self._closed = True
        supervisors = list(self.supervisors.values())
        self.supervisors.clear()
        await asyncio.gather(*(s.stop() for s in supervisors), *self._stopping)
