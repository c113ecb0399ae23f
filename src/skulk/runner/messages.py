"""What crosses the queues between a supervisor and its runner process. Small, picklable, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from skulk.types.chunks import Chunk
from skulk.types.diagnostics import FlightRecorderEntry
from skulk.types.ids import CommandId, TaskId
from skulk.types.runners import RunnerStatus
from skulk.types.tasks import Task, TaskStatus
from skulk.types.tracing import TraceSpan


@dataclass(frozen=True, slots=True)
class RunTask:
    task: Task


@dataclass(frozen=True, slots=True)
class CancelTask:
    task_id: TaskId


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


ToRunner = RunTask | CancelTask | Shutdown


@dataclass(frozen=True, slots=True)
class StatusChanged:
    status: RunnerStatus


@dataclass(frozen=True, slots=True)
class Tokens:
    """Every token of one engine step in one queue message: IPC per step, not per token."""

    chunks: Sequence[Chunk]


@dataclass(frozen=True, slots=True)
class TaskAccepted:
    task_id: TaskId


@dataclass(frozen=True, slots=True)
class TaskEnded:
    task_id: TaskId
    command_id: CommandId
    status: TaskStatus
    error: str | None = None
    retryable: bool = True


@dataclass(frozen=True, slots=True)
class Records:
    entries: list[FlightRecorderEntry] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent every RUNNER_HEARTBEAT_S by a thread of the runner's own: silence means the whole process is frozen or
    gone (a long prefill on the main thread does not stop it)."""


@dataclass(frozen=True, slots=True)
class Spans:
    """Trace spans of traced tasks (runtime tracing), flushed with the flight recorder between steps."""

    spans: list[TraceSpan] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Footprint:
    """Sent once, when the runner is warm: what its process holds resident (RSS) and how much of that is its
    weights and the KV pages it zeroed; the rest is the runtime's overhead, which the node reports
    (types/node_info.RunnerOverhead) for placement to count."""

    resident: int
    weights: int
    kv: int

    @property
    def overhead(self) -> int:
        return max(0, self.resident - self.weights - self.kv)


RUNNER_HEARTBEAT_S = 1.0
"""How often a runner process tells its supervisor it is alive (`Heartbeat`): the supervisor declares it hung only
after `hung_s` (15 s) of silence, many beats, so one late beat on a loaded machine is no fault."""

FromRunner = StatusChanged | Tokens | TaskAccepted | TaskEnded | Records | Heartbeat | Spans | Footprint
