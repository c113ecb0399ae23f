"""The worker shell: after every state change, plan, then start/stop runners and route tasks to them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from skulk.config import Settings
from skulk.master.cycles import ring_hosts
from skulk.master.decide import node_name
from skulk.runner.messages import Footprint, TaskEnded
from skulk.runner.spec import RunnerSpec
from skulk.structured_log import log_context
from skulk.types.chunks import Chunk, TokenChunk
from skulk.types.events import Event, InstanceFailed, RunnerStatusUpdated, TaskFailed, TaskStatusUpdated
from skulk.types.ids import CommandId, InstanceId, NodeId, RunnerId, TaskId
from skulk.types.instances import MlxRingInstance
from skulk.types.node_info import RankRole, rank_role
from skulk.types.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerStatus,
    RunnerWarmingUp,
)
from skulk.types.state import State
from skulk.types.tasks import Task, TaskStatus
from skulk.types.tracing import TraceSpan
from skulk.worker.compute import ComputeLearner
from skulk.worker.overheads import OverheadMeter
from skulk.worker.plan import (
    Action,
    CancelRunnerTask,
    LocalRunner,
    RestartRunner,
    SendTask,
    StartRunner,
    StopRunner,
    plan,
)
from skulk.worker.spare import SpareRunner
from skulk.worker.supervisor import RunnerSupervisor, SupervisorCallbacks

if TYPE_CHECKING:
    from skulk.cluster.payloads import PayloadFetcher

log = logging.getLogger("skulk.worker")

ModelDirFor = Callable[[MlxRingInstance], Path]
DraftDirFor = Callable[[MlxRingInstance], Path | None]


_DEFAULTS = Settings()

STARTING = RunnerIdle | RunnerConnecting | RunnerConnected | RunnerLoading | RunnerLoaded | RunnerWarmingUp
"""A runner's statuses before it is ready (RunnerIdle: spawned, nothing heard yet)."""


class Worker:
    def __init__(
        self,
        node_id: NodeId,
        *,
        emit: Callable[[Event], None],
        publish: Callable[[Sequence[Chunk], Mapping[CommandId, NodeId | None]], None],
        model_dir_for: ModelDirFor,
        warmup_deadline_s: float,
        group_timeout_s: float = _DEFAULTS.group_timeout_seconds,
        prefill_chunk_tokens: int = _DEFAULTS.prefill_chunk_tokens,
        fault: str | None = None,
        record: bool = True,
        runner_restart_budget: int = _DEFAULTS.runner_restart_budget,
        runner_restart_window_s: float = _DEFAULTS.runner_restart_window_seconds,
        runner_hung_s: float = _DEFAULTS.runner_hung_seconds,
        on_spans: Callable[[list[TraceSpan]], None] | None = None,
        payloads: PayloadFetcher | None = None,
        draft_dir_for: DraftDirFor = lambda _: None,
        spare: SpareRunner | None = None,
        on_runner_gone: Callable[[], None] = lambda: None,
    ) -> None:
        self.spare = spare
        """The node's spare runner (worker/spare.py): filled at the node's info rounds (`warm_spare`), once its
        start and each runner's first moments after ready are behind it; None: every runner is spawned cold."""
        self.payloads = payloads
        self.compute = ComputeLearner()
        """This node's decode speed, learned from its single-rank runners' steps (node info reports it)."""
        self.overheads = OverheadMeter()
        """What this node's runners hold besides weights and KV, as they measured it (node info reports it)."""
        """Where a task's prompt comes from (its API node, point to point); None: tasks carry it already."""
        self._fetching: set[tuple[RunnerId, TaskId]] = set()
        self._origins: dict[CommandId, NodeId | None] = {}
        """The API node of each open command this node's runners were given: where their chunks go."""
        self._deliveries: set[asyncio.Task[None]] = set()
        self._state = State()
        self.on_spans = on_spans
        """Where runners' trace spans go (the node's trace store); None drops them."""
        self.restart_budget = runner_restart_budget
        self.restart_window_s = runner_restart_window_s
        self.hung_s = runner_hung_s
        self.node_id = node_id
        self.emit = emit
        self.publish = publish
        """A runner's step of chunks, with each command's API node (api/requests.Requests.deliver_step)."""
        self.model_dir_for = model_dir_for
        self.draft_dir_for = draft_dir_for
        """Where the instance's draft model is on this node, if its card names one and its files are here."""
        self.warmup_deadline_s = warmup_deadline_s
        self.group_timeout_s = group_timeout_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.fault = fault
        self.record = record
        self.supervisors: dict[RunnerId, RunnerSupervisor] = {}
        self._retiring: dict[RunnerId, RunnerSupervisor] = {}
        """Runners being stopped: their processes may still read their model's files until they are gone."""
        self.on_runner_gone = on_runner_gone
        """Called when a stopped runner's process is gone (a deferred eviction may run now)."""
        self._stopping: set[asyncio.Task[None]] = set()
        self._failed_logged: set[InstanceId] = set()
        self._closed = False

    def local_view(self) -> dict[RunnerId, LocalRunner]:
        return {
            rid: LocalRunner(rid, frozenset(s.view.sent), frozenset(s.view.in_progress), s.spec.attempt)
            for rid, s in self.supervisors.items()
        }

    def reconcile(self, state: State) -> None:
        if self._closed:
            return
        self._state = state
        for action in plan(state, self.node_id, self.local_view()):
            self._execute(action, state)
        open_commands = {t.command_id for t in state.tasks.values() if t.task_status.is_open}
        if self.payloads is not None:
            self.payloads.forget(open_commands)
        self._origins = {c: o for c, o in self._origins.items() if c in open_commands}
        for supervisor in self.supervisors.values():
            supervisor.forget_finished(state)
        self._log_failed_instances(state)

    def _log_failed_instances(self, state: State) -> None:
        """One line when an instance this node serves is failed for good (the master decided, or we did)."""
        for supervisor in self.supervisors.values():
            iid = supervisor.spec.instance_id
            retries = state.instance_retries.get(iid)
            if retries is not None and retries.failed is not None and iid not in self._failed_logged:
                self._failed_logged.add(iid)
                log.warning("instance %s failed for good, not restarted again: %s", iid[:8], retries.failed)

    def _execute(self, action: Action, state: State) -> None:
        match action:
            case StartRunner(instance=instance, runner_id=runner_id, attempt=attempt):
                self._start_runner(instance, runner_id, attempt)
            case StopRunner(runner_id=runner_id):
                self._stop_runner(runner_id)
            case RestartRunner(instance=instance, runner_id=runner_id, attempt=attempt, why=why):
                self._log_retry(state, instance, runner_id, why)
                self._start_runner(instance, runner_id, attempt, after=self._stop_runner(runner_id))
            case SendTask(runner_id=runner_id, task=task):
                self._send(runner_id, task)
            case CancelRunnerTask(runner_id=runner_id, task_id=task_id):
                self.supervisors[runner_id].cancel(task_id)

    def _send(self, runner_id: RunnerId, task: Task) -> None:
        """Hand a task to its runner, once its payload has come from the API node that took the request."""
        self._origins[task.command_id] = task.origin_node_id
        if task.task_params is not None or self.payloads is None:
            self.supervisors[runner_id].send_task(task)
            return
        params = self.payloads.local(task)
        if params is not None:  # this node took the request: no query, no turn of the loop
            self.supervisors[runner_id].send_task(task.model_copy(update={"task_params": params}))
            return
        if (runner_id, task.task_id) in self._fetching:
            return  # plan() asks again on every state change while the payload is on its way
        self._fetching.add((runner_id, task.task_id))
        delivery = asyncio.get_running_loop().create_task(self._deliver(runner_id, task, self.payloads))
        self._deliveries.add(delivery)
        delivery.add_done_callback(self._deliveries.discard)

    async def _deliver(self, runner_id: RunnerId, task: Task, payloads: PayloadFetcher) -> None:
        try:
            params = await payloads.fetch(task)
        finally:
            self._fetching.discard((runner_id, task.task_id))
        current = self._state.tasks.get(task.task_id)
        supervisor = self.supervisors.get(runner_id)
        if supervisor is None or current is None or not current.task_status.is_open:
            return
        if params is None:
            log.warning("task %s: its payload could not be fetched from node %s", task.task_id[:8],
                        (task.origin_node_id or "?")[:8])
            self.emit(TaskFailed(task_id=task.task_id, retryable=True,
                                 error_message="the request's prompt could not be fetched from the node that "
                                 "took it; retry"))
            return
        supervisor.send_task(task.model_copy(update={"task_params": params}))

    def _ring_hosts(self, instance: MlxRingInstance) -> tuple[str, ...]:
        """An MLX instance of several ranks meets over MLX's ring backend, at ports from the rendezvous range."""
        if instance.engine != "mlx" or instance.mixed or instance.world_size == 1 or instance.rendezvous is None:
            return ()
        a = instance.shard_assignments
        node_of = {r: n for n, r in a.node_to_runner.items()}
        ranks = [node_of[r] for r, s in sorted(a.runner_to_shard.items(), key=lambda kv: kv[1].device_rank)]
        return tuple(ring_hosts(self._state.topology.connections, ranks, instance.rendezvous.port))

    def _log_retry(self, state: State, instance: MlxRingInstance, runner_id: RunnerId, why: str) -> None:
        retries = state.instance_retries.get(instance.instance_id)
        recent = retries.recent if retries is not None else []
        in_window = len(retries.within(recent[-1] if recent else None, self.restart_window_s)) if retries else 1
        log.info(
            "instance %s retrying as a whole (attempt %d of %d within %.0f s): restarting rank %d: %s",
            instance.instance_id[:8], in_window, self.restart_budget, self.restart_window_s,
            instance.shard_assignments.runner_to_shard[runner_id].device_rank, why,
        )

    def runs(self, instance: MlxRingInstance) -> bool:
        """A runner of the instance is started here (whatever its files say now, it is not stopped for that)."""
        return any(r in self.supervisors for r in instance.shard_assignments.runner_to_shard)

    def live_models(self) -> set[str]:
        """The models this node's runner processes use right now, starting, loading, serving or stopping: what
        eviction must never pull files from under (the supervisors know, the state only says what should run), a
        draft model a runner loaded beside its target included."""
        live = [*self.supervisors.values(), *self._retiring.values()]
        drafts: set[str] = {d for s in live if s.spec.draft_dir is not None
                            and (d := s.spec.shard.model_card.draft_model) is not None}
        return {s.spec.shard.model_card.model_id for s in live} | drafts

    def _stop_runner(self, runner_id: RunnerId) -> asyncio.Task[None]:
        supervisor = self.supervisors.pop(runner_id)
        self._retiring[runner_id] = supervisor
        task = asyncio.get_running_loop().create_task(supervisor.stop())
        self._stopping.add(task)

        def gone(done: asyncio.Task[None]) -> None:
            self._stopping.discard(done)
            if self._retiring.get(runner_id) is supervisor:
                del self._retiring[runner_id]
            log.info("runner %s stopped (exit code %s)", runner_id[:8], supervisor.view.exit_code)
            self.on_runner_gone()

        task.add_done_callback(gone)
        return task

    def _start_runner(
        self,
        instance: MlxRingInstance,
        runner_id: RunnerId,
        attempt: int = 0,
        *,
        after: asyncio.Task[None] | None = None,
    ) -> None:
        """Start the rank's runner; a restarted rank waits for its old process to be gone first, so the two
        never hold the rendezvous port (or the accelerator) at once."""
        shard = instance.shard_assignments.runner_to_shard[runner_id]
        spec = RunnerSpec(
            node_id=self.node_id,
            runner_id=runner_id,
            instance_id=instance.instance_id,
            shard=shard,
            sharding=instance.sharding,
            engine=instance.engines().get(self.node_id, instance.engine),
            mixed=instance.mixed,
            ring_hosts=self._ring_hosts(instance),
            context_length=instance.admits,
            kv_cache_bytes=instance.kv_cache_bytes.get(runner_id),
            model_dir=self.model_dir_for(instance),
            draft_dir=self.draft_dir_for(instance) if shard.world_size == 1 else None,
            rendezvous=instance.rendezvous,
            warmup_deadline_s=self.warmup_deadline_s,
            group_timeout_s=self.group_timeout_s,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            fault=self.fault,
            record=self.record,
            attempt=attempt,
        )
        with log_context(instance_id=instance.instance_id, runner_id=runner_id):
            log.info("starting runner %s for %s (rank %d/%d, layers %d-%d)", runner_id[:8], shard.model_card.model_id,
                     shard.device_rank, shard.world_size, shard.start_layer, shard.end_layer)
        supervisor = RunnerSupervisor(
            spec,
            self._callbacks(runner_id, instance.instance_id, is_sampler=shard.is_last,
                            learn_bytes=shard.model_card.storage_size.in_bytes if shard.world_size == 1 else 0,
                            role=rank_role(shard.device_rank)),
            restart_budget=self.restart_budget,
            restart_window_s=self.restart_window_s,
            hung_s=self.hung_s,
            restarts_locally=instance.meta_instance_id is None,
            spare=self.spare,
        )
        self.supervisors[runner_id] = supervisor
        if after is None:
            supervisor.start()
            return
        task = asyncio.get_running_loop().create_task(self._start_after(after, supervisor))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _start_after(self, stopping: asyncio.Task[None], supervisor: RunnerSupervisor) -> None:
        await asyncio.wait([stopping])
        if not self._closed and self.supervisors.get(supervisor.spec.runner_id) is supervisor:
            supervisor.start()

    def _callbacks(self, runner_id: RunnerId, instance_id: InstanceId, *, is_sampler: bool,
                   learn_bytes: int = 0, role: RankRole = "first") -> SupervisorCallbacks:
        """`learn_bytes`: the model's weight bytes when this runner's steps teach the node its compute (a
        single-rank runner), else 0. `role`: the rank's, for its measured overhead (worker/overheads.py)."""
        def on_status(status: RunnerStatus) -> None:
            self.emit(RunnerStatusUpdated(runner_id=runner_id, runner_status=status))
            if isinstance(status, RunnerReady) and self.spare is not None:  # its first requests come first
                self.spare.hold_off()

        def on_chunks(chunks: Sequence[Chunk]) -> None:
            if learn_bytes:  # one Tokens message per engine step: a clock read and a count, not per token
                tokens = [c for c in chunks if isinstance(c, TokenChunk)]
                self.compute.on_step(runner_id, len({c.command_id for c in tokens}), learn_bytes,
                                     time.perf_counter(), tokens=len(tokens),
                                     decode_only=all(c.completion_tokens > 1 for c in tokens))
            self.publish(chunks, self._origins)

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

        def on_gave_up(why: str) -> None:
            name = node_name(self._state, self.node_id)
            self.emit(InstanceFailed(instance_id=instance_id, failure_error=f"{name}: {why}"))

        def on_footprint(measured: Footprint) -> None:  # only torch ranks measure (runner/core.py)
            self.overheads.record("torch", role, measured.overhead)

        return SupervisorCallbacks(on_status, on_chunks, on_task_started, on_task_ended, on_gave_up, self.on_spans,
                                   on_footprint)

    def warm_spare(self) -> None:
        """Keep a spare runner ready (none while a runner of this node is still loading: they would share cores)."""
        if self.spare is None or self._closed:
            return
        if any(s.alive and isinstance(s.view.status, STARTING) for s in self.supervisors.values()):
            return
        self.spare.fill()

    async def stop(self) -> None:
        self._closed = True
        supervisors = list(self.supervisors.values())
        self.supervisors.clear()
        spare = asyncio.to_thread(self.spare.close) if self.spare is not None else asyncio.sleep(0)
        await asyncio.gather(*(s.stop() for s in supervisors), *self._stopping, spare)
