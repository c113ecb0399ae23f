"""What nodes send to the master: LocalEvents on `local_events/<node_id>`, commands on `commands`.

Senders may resend (a master change, a retry), so the master drops LocalEvents it has already seen by
(origin, seq). Commands carry their own command_id; de-duplicating those is the command handler's business.

Both are addressed to one master in one term, and a master refuses what was addressed to another (issue 27):
sealing stops a host without the key from forging a message, and each subscription's replay window stops it
from re-sending one to the master that already took it, but a new master's intake starts with an empty window,
so a ciphertext captured in term T would be news to the master of term T+1. The binding makes it stale there.
A master that is re-created on the same node keeps its predecessor's windows (Transport durable windows).
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


def send_command(
    transport: Transport, origin: NodeId, command: Command, *, term: int = 0, master: NodeId | None = None
) -> None:
    """To the master of `term` (the sender's view): no other master will take it."""
    payload = ForwardedCommand(origin=origin, command=command, term=term, master=master).model_dump_json().encode()
    transport.put(COMMANDS_KEY, payload)


def addressed_here(term: int, master: NodeId | None, to_term: int, to_master: NodeId | None) -> bool:
    """Whether a message addressed to (to_master, to_term) is for the master (master, term) (pure). An intake
    without an address (master None: tests of the plumbing alone) takes everything."""
    return master is None or (to_term, to_master) == (term, master)


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
        *,
        term: int = 0,
        master: NodeId | None = None,
    ) -> None:
        self._transport = transport
        self.term, self.master = term, master
        self.misaddressed = 0
        """Messages refused because they were addressed to another master or term: late ones from a failover,
        or replays."""
        self._on_local_event = on_local_event
        self._on_command = on_command
        self._dedup = Deduplicator()
        self._entities: list[Any] = []

    def start(self) -> None:
        self._entities.append(self._transport.subscribe(LOCAL_EVENTS_PREFIX + "*", self._local_event, durable=True))
        self._entities.append(self._transport.subscribe(COMMANDS_KEY, self._command, durable=True))

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
        if not self._addressed_here(event.term, event.master, "local event", event.origin):
            return
        if self._dedup.first_time(event.origin, event.seq):
            self._on_local_event(event)

    def _command(self, key: str, payload: bytes) -> None:
        try:
            command = ForwardedCommand.model_validate_json(payload)
        except ValidationError:
            log.warning("dropping malformed command on %s", key)
            return
        if not self._addressed_here(command.term, command.master, "command", command.origin):
            return
        self._on_command(command)

    def _addressed_here(self, term: int, master: NodeId | None, what: str, origin: str) -> bool:
        if addressed_here(self.term, self.master, term, master):
            return True
        self.misaddressed += 1
        self._transport.count_replayed()
        log.info("refused a %s from %s addressed to master %s term %d (this is %s term %d): late or replayed",
                 what, origin[:8], (master or "none")[:8], term, (self.master or "none")[:8], self.term)
        return False
