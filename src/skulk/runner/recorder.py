"""The runner's flight recorder: phase changes as entries, shipped to the supervisor without ever blocking.

Entries wait in a bounded deque that drops the oldest; the runner loop flushes them between engine steps.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

import psutil

from skulk.diagnostics.clock import now_iso
from skulk.types.diagnostics import AttrValue, FlightRecorderEntry, MlxMemorySnapshot, RunnerContext
from skulk.types.memory import Memory
from skulk.types.runners import RunnerPhase

PENDING_LIMIT = 256


def memory_snapshot() -> MlxMemorySnapshot:
    """torch.cuda when the shard runs on a GPU, else the process RSS through psutil."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return MlxMemorySnapshot(
                generated_at=now_iso(),
                active=Memory.from_bytes(torch.cuda.memory_allocated()),
                cache=Memory.from_bytes(torch.cuda.memory_reserved()),
                peak=Memory.from_bytes(torch.cuda.max_memory_allocated()),
                source="torch.cuda",
            )
    except ImportError:
        pass
    rss = psutil.Process(os.getpid()).memory_info().rss
    return MlxMemorySnapshot(generated_at=now_iso(), active=Memory.from_bytes(rss), source="psutil")


class FlightRecorder:
    def __init__(self, context: RunnerContext, *, enabled: bool = True) -> None:
        self.context = context
        self.enabled = enabled
        self.phase: RunnerPhase = "created"
        self.phase_since = time.monotonic()
        self._pending: deque[FlightRecorderEntry] = deque(maxlen=PENDING_LIMIT)
        # called after a new phase's entry is queued (fault injection); None costs nothing
        self.on_enter: Callable[[RunnerPhase], None] | None = None

    def record(
        self,
        phase: RunnerPhase,
        event: str,
        detail: str | None = None,
        *,
        task_id: str | None = None,
        command_id: str | None = None,
        with_memory: bool = False,
        **attrs: AttrValue,
    ) -> None:
        entered = phase != self.phase
        if entered:
            self.phase, self.phase_since = phase, time.monotonic()
        if self.enabled:
            self._append(phase, event, detail, task_id, command_id, with_memory, attrs)
        if entered and self.on_enter is not None:
            self.on_enter(phase)

    def _append(
        self,
        phase: RunnerPhase,
        event: str,
        detail: str | None,
        task_id: str | None,
        command_id: str | None,
        with_memory: bool,
        attrs: dict[str, AttrValue],
    ) -> None:
        self._pending.append(
            FlightRecorderEntry(
                at=now_iso(),
                phase=phase,
                event=event,
                detail=detail,
                attrs=attrs,
                context=self.context,
                task_id=task_id,
                command_id=command_id,
                mlx_memory=memory_snapshot() if with_memory else None,
            )
        )

    def drain(self) -> list[FlightRecorderEntry]:
        entries = list(self._pending)
        self._pending.clear()
        return entries
