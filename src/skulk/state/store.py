"""A node's copy of the cluster state: applies ordered events and wakes whoever waits for a change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from skulk.state.apply import apply
from skulk.types.events import IndexedEvent
from skulk.types.state import State

Listener = Callable[[State, IndexedEvent | None], None]


class StateStore:
    def __init__(self, state: State | None = None) -> None:
        self.state = state or State()
        self._listeners: list[Listener] = []
        self._changed = asyncio.Event()

    @property
    def next_idx(self) -> int:
        return self.state.last_event_applied_idx + 1

    def listen(self, listener: Listener) -> Callable[[], None]:
        """listener(state, event) after every change (None for a snapshot). Returns an unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def apply(self, indexed: IndexedEvent) -> None:
        if indexed.idx < self.next_idx:
            return
        self.state = apply(self.state, indexed)
        self._notify(indexed)

    def replace(self, state: State) -> None:
        """Adopt the master's snapshot: it is authoritative, even over events we applied from a deposed one."""
        self.state = state
        self._notify(None)

    def _notify(self, event: IndexedEvent | None) -> None:
        for listener in list(self._listeners):
            listener(self.state, event)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[State], bool], timeout: float) -> bool:
        """True once predicate(state) holds; False when timeout passes first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self.state):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):  # not wait_for: on 3.11 it can drop a cancel
                    await self._changed.wait()
            except TimeoutError:
                return predicate(self.state)
        return True
