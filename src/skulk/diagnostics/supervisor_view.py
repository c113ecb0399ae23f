"""One live runner supervisor → RunnerSupervisorDiagnostics (seed 001) → ClusterTimelineRunner (seed 000).

Pure: reads the supervisor's view and spec and a `now`. Call it on the event loop that owns the supervisor,
because the supervisor mutates its deques there; the copies it returns are then safe to hand to any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Protocol

from skulk.diagnostics.clock import seconds_since
from skulk.types.diagnostics import FlightRecorderEntry, Milestone, MlxMemorySnapshot, RunnerContext
from skulk.types.diagnostics_bundle import (
    ClusterTimelineRunner,
    RunnerSupervisorDiagnostics,
    TaskDiagnostics,
)
from skulk.types.ids import TaskId
from skulk.types.runners import RunnerPhase
from skulk.types.state import State
from skulk.types.tasks import Task

# Phases after which the task named by the last entry is over, so it is no longer "active".
SETTLED_PHASES: frozenset[RunnerPhase] = frozenset({"idle", "completion", "error", "shutdown_cleanup"})


class SpecLike(Protocol):
    """What diagnostics read from a RunnerSpec: its stable identity."""

    def context(self, pid: int | None) -> RunnerContext: ...


class ViewLike(Protocol):
    """What diagnostics read from a SupervisorView; a plain fake object satisfies it in tests."""

    @property
    def status(self) -> object: ...
    @property
    def status_since(self) -> str: ...
    @property
    def phase(self) -> RunnerPhase: ...
    @property
    def phase_started_at(self) -> str: ...
    @property
    def phase_detail(self) -> str | None: ...
    @property
    def last_progress_at(self) -> str | None: ...
    @property
    def flight_recorder(self) -> Iterable[FlightRecorderEntry]: ...
    @property
    def milestones(self) -> Iterable[Milestone]: ...
    @property
    def pending(self) -> Mapping[TaskId, Task]: ...
    @property
    def in_progress(self) -> Mapping[TaskId, Task]: ...
    @property
    def completed_count(self) -> int: ...
    @property
    def cancelled(self) -> Sequence[TaskId]: ...
    @property
    def last_task_sent_at(self) -> str | None: ...
    @property
    def last_event_received_at(self) -> str | None: ...
    @property
    def last_event_type(self) -> str | None: ...
    @property
    def exit_code(self) -> int | None: ...


class SupervisorLike(Protocol):
    """The part of RunnerSupervisor that diagnostics and the cancel endpoint use."""

    @property
    def spec(self) -> SpecLike: ...
    @property
    def view(self) -> ViewLike: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def restart_count(self) -> int: ...

    def cancel(self, task_id: TaskId) -> None: ...


def task_diagnostics(task: Task, runner_id: str | None, state: State | None) -> TaskDiagnostics:
    """The state's status wins over the supervisor's copy, which is frozen at the time it was sent."""
    known = state.tasks.get(task.task_id) if state is not None else None
    status = (known or task).task_status
    return TaskDiagnostics(
        task_id=task.task_id,
        task_kind=type(task).__name__,
        task_status=str(status),
        instance_id=task.instance_id,
        command_id=task.command_id,
        runner_id=runner_id,
        model_id=task.model,
    )


def _active_ids(view: ViewLike, entries: Sequence[FlightRecorderEntry]) -> tuple[str | None, str | None]:
    """The task of the current phase: the newest entry's, unless the phase settled; else the open task."""
    last = entries[-1] if entries else None
    if last is not None and last.task_id and view.phase not in SETTLED_PHASES:
        return last.task_id, last.command_id
    if view.phase in SETTLED_PHASES:
        return None, None
    task = next(iter(view.in_progress.values()), None)
    return (task.task_id, task.command_id) if task is not None else (None, None)


def _last_memory(entries: Sequence[FlightRecorderEntry]) -> MlxMemorySnapshot | None:
    return next((e.mlx_memory for e in reversed(entries) if e.mlx_memory is not None), None)


def supervisor_diagnostics(
    supervisor: SupervisorLike, now: datetime, state: State | None = None
) -> RunnerSupervisorDiagnostics:
    view, pid = supervisor.view, supervisor.pid
    ctx = supervisor.spec.context(pid)
    entries = list(view.flight_recorder)
    task_id, command_id = _active_ids(view, entries)
    return RunnerSupervisorDiagnostics(
        runner_id=ctx.runner_id,
        instance_id=ctx.instance_id,
        node_id=ctx.node_id,
        model_id=ctx.model_id,
        device_rank=ctx.rank,
        world_size=ctx.world_size,
        start_layer=ctx.start_layer,
        end_layer=ctx.end_layer,
        n_layers=ctx.n_layers,
        pid=pid,
        process_alive=supervisor.alive,
        exit_code=view.exit_code,
        status_kind=type(view.status).__name__,
        status_since=view.status_since,
        seconds_in_status=seconds_since(view.status_since, now),
        phase=view.phase,
        phase_started_at=view.phase_started_at,
        seconds_in_phase=seconds_since(view.phase_started_at, now),
        last_progress_at=view.last_progress_at,
        active_task_id=task_id,
        active_command_id=command_id,
        phase_detail=view.phase_detail,
        last_mlx_memory=_last_memory(entries),
        flight_recorder=entries,
        pending_task_ids=list(view.pending),
        in_progress_tasks=[task_diagnostics(t, ctx.runner_id, state) for t in view.in_progress.values()],
        completed_task_count=view.completed_count,
        cancelled_task_ids=list(view.cancelled),
        last_task_sent_at=view.last_task_sent_at,
        last_event_received_at=view.last_event_received_at,
        last_event_type=view.last_event_type,
        milestones=list(view.milestones),
    )


def timeline_runner(diag: RunnerSupervisorDiagnostics) -> ClusterTimelineRunner:
    """The seed-000 synopsis is a strict subset of the seed-001 view."""
    return ClusterTimelineRunner.model_validate(
        diag.model_dump(include=set(ClusterTimelineRunner.model_fields))
    )
