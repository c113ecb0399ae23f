"""The node's side of runtime tracing: where runners' spans are saved, the API node's own span, the janitor.

Which tasks are traced is decided once, by the master, when it creates a task (task.traced, from the
event-sourced flag), so flipping the flag never reaches requests already in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from skulk.tracing.store import TraceStore
from skulk.types.commands import Command, SetTracingEnabled
from skulk.types.ids import CommandId, new_id
from skulk.types.state import State
from skulk.types.tasks import Task
from skulk.types.tracing import TraceSpan

log = logging.getLogger("skulk.tracing")

JANITOR_FIRST_S = 60.0
JANITOR_EVERY_S = 3600.0


def task_of_command(state: State, command_id: str) -> Task | None:
    return next((t for t in state.tasks.values() if t.command_id == command_id), None)


class NodeTracing:
    def __init__(self, home: Path, node_id: str, state: Callable[[], State], retention_days: float) -> None:
        self.store = TraceStore(home / "traces", node_id)
        self._state = state
        self.retention_days = retention_days
        self._streams: dict[str, float] = {}

    def on_spans(self, spans: list[TraceSpan]) -> None:
        """From a runner (via its supervisor), on the event loop: save them with the task's model and kind."""
        if not spans:
            return
        task = self._state().tasks.get(spans[0].task_id)  # type: ignore[arg-type]
        model = task.model if task is not None else None
        self.store.add(spans, model, type(task).__name__ if task is not None else None)

    def stream_opened(self, command_id: str) -> None:
        self._streams[command_id] = time.time()

    def stream_closed(self, command_id: str) -> None:
        """The API node's span of a traced request: from subscribing to its tokens to closing the stream."""
        started = self._streams.pop(command_id, None)
        if started is None:
            return
        task = task_of_command(self._state(), command_id)
        if task is None or not task.traced:
            return
        start_us, end_us = int(started * 1e6), int(time.time() * 1e6)
        span = TraceSpan(task_id=task.task_id, name="api_stream", category="api", start_us=start_us,
                         duration_us=end_us - start_us)
        self.store.add([span], task.model, type(task).__name__)

    def initial_command(self, configured: bool) -> Command | None:
        """tracing.enabled / SKULK_TRACING_ENABLED applies while nobody has set the flag in this cluster."""
        if self._state().tracing_enabled is None and configured:
            return SetTracingEnabled(command_id=CommandId(new_id()), enabled=True)
        return None

    async def janitor(self) -> None:
        """Hourly (first 60 s after start): delete traces older than tracing.retention_days (0: never)."""
        await asyncio.sleep(JANITOR_FIRST_S)
        while True:
            try:
                await asyncio.to_thread(self.store.prune, self.retention_days)
            except OSError as exc:
                log.warning("trace janitor could not prune %s: %s", self.store.directory, exc)
            await asyncio.sleep(JANITOR_EVERY_S)
