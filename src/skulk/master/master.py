"""The master shell: take commands and local events, decide with pure functions, emit ordered events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from skulk.cluster.intake import Intake
from skulk.cluster.sync import Sequencer
from skulk.cluster.transport import Transport
from skulk.master.decide import (
    RESTART_BUDGET,
    RESTART_WINDOW_S,
    events_for_command,
    events_for_lost_node,
    events_for_new_session,
    events_for_unhealthy_instances,
)
from skulk.state.apply import apply
from skulk.types.commands import ForwardedCommand
from skulk.types.events import Event, InstanceDeleted, LocalEvent, TaskFailed
from skulk.types.ids import NodeId, TaskId, new_id
from skulk.types.state import State

log = logging.getLogger("skulk.master")

RECONCILE_EVERY_S = 1.0


class Master:
    def __init__(
        self,
        transport: Transport,
        node_id: NodeId,
        term: int,
        state: State,
        alive: Callable[[], frozenset[NodeId]],
        frozen: Callable[[], bool] = lambda: False,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any] | None] | None = None,
        restart_budget: int = RESTART_BUDGET,
        restart_window_s: float = RESTART_WINDOW_S,
    ) -> None:
        self.restart_budget = restart_budget
        self.restart_window_s = restart_window_s
        self._spawn = spawn or asyncio.get_running_loop().create_task
        self.node_id = node_id
        self.term = term
        self.state = state
        self.alive = alive
        self.frozen = frozen
        """True while this process is back from a freeze and has not stepped down yet: its view of who is
        alive is stale (every lease looks expired), so it must not declare anyone lost on it."""
        self.sequencer = Sequencer(
            transport,
            first_idx=state.last_event_applied_idx + 1,
            snapshot=self._snapshot,
            term=term,
            master=node_id,
        )
        self.intake = Intake(transport, on_local_event=self.on_local_event, on_command=self.on_command)
        self._reconciler: asyncio.Task[None] | None = None

    def _snapshot(self) -> bytes:
        return self.state.model_dump_json().encode()

    def start(self) -> None:
        session = events_for_new_session(self.state, self.node_id, self.term)
        failed = sum(isinstance(e, TaskFailed) for e in session)
        log.info("master %s starts term %d at event %d; failing %d open requests of the old session",
                 self.node_id[:8], self.term, self.sequencer.next_idx, failed)
        self.sequencer.start()
        self.intake.start()
        self.emit(session)
        self.reconcile()
        self._reconciler = self._spawn(self._reconcile_forever())

    def stop(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
        self.intake.stop()
        self.sequencer.stop()

    def emit(self, events: list[Event]) -> None:
        if not events:
            return
        for indexed in self.sequencer.emit(events):
            self.state = apply(self.state, indexed)

    def on_command(self, forwarded: ForwardedCommand) -> None:
        events = events_for_command(self.state, forwarded.command, TaskId(new_id()))
        for event in events:
            if isinstance(event, InstanceDeleted):
                log.info("instance %s deleted on request (command %s)", event.instance_id[:8],
                         forwarded.command.command_id[:8])
        self.emit(events)

    def on_local_event(self, local: LocalEvent) -> None:
        self.emit([local.event])

    def on_node_lost(self, node: NodeId, why: str = "its liveliness token is gone") -> None:
        if self.frozen():
            return
        events = events_for_lost_node(self.state, node)
        if not events:
            return
        deleted = [e.instance_id[:8] for e in events if isinstance(e, InstanceDeleted)]
        failed = sum(isinstance(e, TaskFailed) for e in events)
        log.info("node %s lost (%s): deleting instances %s, failing %d open requests", node[:8], why,
                 deleted or "none", failed)
        self.emit(events)

    def reconcile(self) -> None:
        if self.frozen():
            return
        alive = self.alive()
        known = set(self.state.topology.nodes) | set(self.state.last_seen)
        for node in sorted(known - alive):
            self.on_node_lost(node, "not alive in this master's view")
        self.emit(
            events_for_unhealthy_instances(self.state, budget=self.restart_budget, window_s=self.restart_window_s)
        )

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_EVERY_S)
            try:
                self.reconcile()
            except Exception:
                log.exception("reconcile failed")
