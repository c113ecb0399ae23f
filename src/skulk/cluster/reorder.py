"""Pure ordering of the master's events on a follower: deliver strictly by idx, exactly once.

zenoh does not promise order across a reconnect or between two masters' publications, and a follower may
subscribe mid-stream, so arrivals can be late, early, duplicated or missing. The Reorderer turns that into a
gap-free sequence and says which range is missing; fetching it is the follower shell's job.
"""

from __future__ import annotations

from skulk.types.events import IndexedEvent

DEFAULT_MAX_BUFFERED = 10_000


class Reorderer:
    """Releases events in consecutive idx order starting at next_idx; buffers the ones that are early."""

    def __init__(self, next_idx: int, *, max_buffered: int = DEFAULT_MAX_BUFFERED) -> None:
        if next_idx < 0:
            raise ValueError("next_idx must be >= 0")
        self._next = next_idx
        self._buffer: dict[int, IndexedEvent] = {}
        self._max_buffered = max_buffered

    @property
    def next_idx(self) -> int:
        """The idx of the next event to deliver; everything below it has been delivered (or skipped)."""
        return self._next

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def offer(self, event: IndexedEvent) -> list[IndexedEvent]:
        """Accept one arrival; return the events now ready, in order. Duplicates and stale ones return []."""
        if event.idx < self._next or event.idx in self._buffer:
            return []
        if event.idx != self._next and len(self._buffer) >= self._max_buffered:
            # Keep the events nearest to delivery; a dropped far-ahead one is fetched again with the gap.
            farthest = max(self._buffer)
            if event.idx > farthest:
                return []
            del self._buffer[farthest]
        self._buffer[event.idx] = event
        return self._drain()

    def offer_all(self, events: list[IndexedEvent]) -> list[IndexedEvent]:
        ready: list[IndexedEvent] = []
        for event in events:
            ready.extend(self.offer(event))
        return ready

    def missing(self) -> tuple[int, int] | None:
        """The inclusive idx range between what was delivered and the earliest buffered event, if any."""
        if not self._buffer:
            return None
        return (self._next, min(self._buffer) - 1)

    def reset(self, next_idx: int, *, backwards: bool = False) -> list[IndexedEvent]:
        """Jump to next_idx (a snapshot covered everything before it): drop older buffered events and
        return the buffered ones that are ready from there. Moves backwards only when told to: after
        adopting an authoritative snapshot older than what was delivered, the tail is fetched again."""
        if next_idx <= self._next and not backwards:
            return []
        self._next = next_idx
        self._buffer = {idx: ev for idx, ev in self._buffer.items() if idx >= next_idx}
        return self._drain()

    def _drain(self) -> list[IndexedEvent]:
        ready: list[IndexedEvent] = []
        while self._next in self._buffer:
            ready.append(self._buffer.pop(self._next))
            self._next += 1
        return ready
