"""What nodes send to the master: LocalEvents on `local_events/<node_id>`, commands on `commands`.

Senders may resend (a master change, a retry), so the master drops LocalEvents it has already seen by
(origin, seq). Commands carry their own command_id; de-duplicating those is the command handler's business.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from skulk.types.commands import Command, ForwardedCommand
from skulk.types.events import LocalEvent
from skulk.types.ids import NodeId

from .transport import Transport

log = logging.getLogger(__name__)

LOCAL_EVENTS_PREFIX = "local_events/"
COMMANDS_KEY = "commands"
DEDUP_WINDOW = 4096


def send_local_event(transport: Transport, event: LocalEvent) -> None:
    transport.put(LOCAL_EVENTS_PREFIX + event.origin, event.model_dump_json().encode())


def send_command(transport: Transport, origin: NodeId, command: Command) -> None:
    payload = ForwardedCommand(origin=origin, command=command).model_dump_json().encode()
    transport.put(COMMANDS_KEY, payload)


class Deduplicator:
    """Remembers the last `window` seqs per origin. Seqs older than that window count as seen: a sender
    numbers its events increasingly, so only a resend can be that old."""

    def __init__(self, window: int = DEDUP_WINDOW) -> None:
        self._window = window
        self._highest: dict[NodeId, int] = {}
        self._seen: dict[NodeId, set[int]] = {}

    def first_time(self, origin: NodeId, seq: int) -> bool:
        highest = self._highest.get(origin)
        seen = self._seen.setdefault(origin, set())
        if highest is not None and (seq <= highest - self._window or seq in seen):
            return False
        seen.add(seq)
        if highest is None or seq > highest:
            self._highest[origin] = seq
            floor = seq - self._window
            if len(seen) > self._window:
                self._seen[origin] = {s for s in seen if s > floor}
        return True


class Intake:
    """Master side: receives LocalEvents (de-duplicated) and forwarded commands, on the asyncio loop."""

    def __init__(
        self,
        transport: Transport,
        on_local_event: Callable[[LocalEvent], None],
        on_command: Callable[[ForwardedCommand], None],
    ) -> None:
        self._transport = transport
        self._on_local_event = on_local_event
        self._on_command = on_command
        self._dedup = Deduplicator()
        self._entities: list[Any] = []

    def start(self) -> None:
        self._entities.append(self._transport.subscribe(LOCAL_EVENTS_PREFIX + "*", self._local_event))
        self._entities.append(self._transport.subscribe(COMMANDS_KEY, self._command))

    def stop(self) -> None:
        for entity in self._entities:
            self._transport.undeclare(entity)
        self._entities.clear()

    def _local_event(self, key: str, payload: bytes) -> None:
        try:
            event = LocalEvent.model_validate_json(payload)
        except ValidationError:
            log.warning("dropping malformed local event on %s", key)
            return
        if key != LOCAL_EVENTS_PREFIX + event.origin:
            log.warning("dropping local event from %s published on %s", event.origin, key)
            return
        if self._dedup.first_time(event.origin, event.seq):
            self._on_local_event(event)

    def _command(self, key: str, payload: bytes) -> None:
        try:
            command = ForwardedCommand.model_validate_json(payload)
        except ValidationError:
            log.warning("dropping malformed command on %s", key)
            return
        self._on_command(command)
