"""Ordered events: the master numbers and publishes them, every follower applies them gap-free and in order.

Keys: live events on `events`, each stamped with the (master, term) that emitted it; the master's queryables
`master/<id>/range?from=A&to=B` (inclusive; `to` omitted means up to the newest) and `master/<id>/snapshot`
(the state JSON, including last_event_applied_idx). Queryables are per master so that a follower asks the
master it follows, never a deposed one still answering. A range reply is a JSON list of IndexedEvent, or
`{"tooOld": true, "oldestIdx": N}` when A fell out of the bounded history; the follower then starts over from
the snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from pydantic import TypeAdapter, ValidationError

from skulk.types.events import Event, IndexedEvent
from skulk.types.ids import NodeId
from skulk.types.state import State

from .intake import Deduplicator, Intake, send_command, send_local_event
from .reorder import Reorderer
from .transport import Transport

__all__ = [
    "Deduplicator",
    "EventFollower",
    "History",
    "Intake",
    "Reorderer",
    "Sequencer",
    "TooOld",
    "parse_range",
    "send_command",
    "send_local_event",
]

log = logging.getLogger(__name__)

EVENTS_KEY = "events"
DEFAULT_HISTORY = 10_000
SNAPSHOT_WAIT_S = 2.0

_EVENT_LIST = TypeAdapter(list[IndexedEvent])


def range_key(master: NodeId) -> str:
    return f"master/{master}/range"


def snapshot_key(master: NodeId) -> str:
    return f"master/{master}/snapshot"


class TooOld(Exception):
    """The requested range starts before the oldest event the master still holds."""

    def __init__(self, oldest_idx: int) -> None:
        super().__init__(f"history starts at {oldest_idx}")
        self.oldest_idx = oldest_idx


def parse_range(parameters: str) -> tuple[int, int | None]:
    """`from=A&to=B` -> (A, B); a missing `from` means 0, a missing `to` means up to the newest."""
    query = parse_qs(parameters)
    start = int(query.get("from", ["0"])[0])
    end = query.get("to")
    return start, (int(end[0]) if end else None)


class History:
    """The newest `size` events as JSON, readable from zenoh threads while the loop appends."""

    def __init__(self, first_idx: int, size: int = DEFAULT_HISTORY) -> None:
        self._entries: deque[tuple[int, bytes]] = deque(maxlen=size)
        self._next = first_idx
        self._lock = threading.Lock()

    def append(self, idx: int, payload: bytes) -> None:
        with self._lock:
            self._entries.append((idx, payload))
            self._next = idx + 1

    def select(self, start: int, end: int | None) -> list[bytes]:
        """The payloads with start <= idx <= end; raises TooOld when start precedes what is kept."""
        with self._lock:
            oldest = self._entries[0][0] if self._entries else self._next
            if start < oldest:
                raise TooOld(oldest)
            last = self._next - 1 if end is None else min(end, self._next - 1)
            return [p for idx, p in self._entries if start <= idx <= last]


def encode_range_reply(history: History, parameters: str) -> bytes:
    try:
        start, end = parse_range(parameters)
        payloads = history.select(start, end)
    except TooOld as exc:
        return json.dumps({"tooOld": True, "oldestIdx": exc.oldest_idx}).encode()
    except ValueError:
        return b"[]"
    return b"[" + b",".join(payloads) + b"]"


def decode_range_reply(payload: bytes) -> list[IndexedEvent]:
    """The events of a range reply; raises TooOld if the master no longer holds the start."""
    raw = json.loads(payload)
    if isinstance(raw, dict) and raw.get("tooOld"):
        raise TooOld(int(raw.get("oldestIdx", 0)))
    return _EVENT_LIST.validate_python(raw)


class Sequencer:
    """Master side: numbers events consecutively, publishes them, and answers range and snapshot queries.

    emit() and the snapshot callback both run on the asyncio loop, so a snapshot is always consistent with
    the events already emitted; the range queryable reads the thread-safe History from zenoh's threads.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        first_idx: int,
        snapshot: Callable[[], bytes],
        history_size: int = DEFAULT_HISTORY,
        term: int = 0,
        master: str = "",
    ) -> None:
        self._transport = transport
        self._term = term
        self._master = NodeId(master)
        self._next = first_idx
        self._snapshot = snapshot
        self._history = History(first_idx, history_size)
        self._entities: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def next_idx(self) -> int:
        return self._next

    def start(self) -> None:
        """Serve `events/range` and `snapshot`; call on the asyncio loop."""
        self._loop = asyncio.get_running_loop()
        self._entities.append(self._transport.serve(range_key(self._master), self._answer_range))
        self._entities.append(self._transport.serve(snapshot_key(self._master), self._answer_snapshot))

    def stop(self) -> None:
        for entity in self._entities:
            self._transport.undeclare(entity)
        self._entities.clear()

    def emit(self, events: list[Event]) -> list[IndexedEvent]:
        """Number, remember and publish events; returns them indexed, in order."""
        indexed: list[IndexedEvent] = []
        for event in events:
            item = IndexedEvent(idx=self._next, event=event, term=self._term, master=self._master)
            payload = item.model_dump_json().encode()
            self._history.append(item.idx, payload)
            self._next += 1
            self._transport.put(EVENTS_KEY, payload)
            indexed.append(item)
        return indexed

    def _answer_range(self, key: str, parameters: str) -> bytes | None:
        return encode_range_reply(self._history, parameters)

    def _answer_snapshot(self, key: str, parameters: str) -> bytes | None:
        """Runs on a zenoh thread: hop to the loop for the callback, so it sees a consistent state."""
        if self._loop is None:
            return None
        done: concurrent.futures.Future[bytes] = concurrent.futures.Future()

        def call() -> None:
            try:
                done.set_result(self._snapshot())
            except Exception as exc:
                done.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(call)
            return done.result(timeout=SNAPSHOT_WAIT_S)
        except Exception:
            log.exception("snapshot not served")
            return None


class EventFollower:
    """Follower side: delivers the master's events to on_event strictly in idx order, exactly once.

    Live events come from the `events` subscription; a gap that the network does not fill within gap_wait_s
    is fetched from `events/range`, and a range the master no longer holds falls back to its snapshot.
    Fetches are serialized by one lock so a catch-up and a gap fill never interleave their deliveries.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        next_idx: int,
        on_event: Callable[[IndexedEvent], None],
        on_snapshot: Callable[[State], None],
        gap_wait_s: float = 0.05,
        query_timeout_s: float = 1.0,
    ) -> None:
        self._transport = transport
        self._order = Reorderer(next_idx)
        self._on_event = on_event
        self._on_snapshot = on_snapshot
        self._gap_wait_s = gap_wait_s
        self._query_timeout_s = query_timeout_s
        self._sub: Any = None
        self._fetch_lock = asyncio.Lock()
        self._gap_task: asyncio.Task[None] | None = None
        self._master: NodeId | None = None
        self._term = -1

    def follow(self, master: NodeId | None, term: int) -> None:
        """From now on accept only the events of this (master, term); None accepts nothing (no master).

        Events buffered from anyone else are dropped: a deposed master may still be publishing, and a lone
        master of a healed partition may have used the same term and indices. What the new master emitted
        before we followed it comes with the resync that follows every master change."""
        if (master, term) != (self._master, self._term):
            self._master, self._term = master, term
            self._order = Reorderer(self._order.next_idx)

    @property
    def next_idx(self) -> int:
        return self._order.next_idx

    def start(self) -> None:
        if self._sub is None:
            self._sub = self._transport.subscribe(EVENTS_KEY, self._on_message)

    def stop(self) -> None:
        if self._gap_task is not None:
            self._gap_task.cancel()
        if self._sub is not None and self._transport.is_open:
            self._transport.undeclare(self._sub)
        self._sub = None

    async def catch_up(self, timeout_s: float = 5.0) -> None:
        """For a late joiner: subscribe (buffering live events), load the snapshot, then fetch the tail."""
        self.start()
        async with self._fetch_lock, asyncio.timeout(timeout_s):
            await self._load_snapshot()
            await self._fetch_tail()

    async def _fetch_tail(self) -> None:
        """Everything after what we have; when a new master's history starts later, its snapshot first."""
        try:
            await self._fetch(self._order.next_idx, None)
        except TooOld:
            await self._load_snapshot(force=True)
            await self._fetch(self._order.next_idx, None)

    async def resync(self, timeout_s: float = 5.0) -> None:
        """After a master change: adopt the new master's snapshot whatever we applied, then its tail."""
        async with self._fetch_lock, asyncio.timeout(timeout_s):
            await self._load_snapshot(force=True)
            await self._fetch_tail()

    async def reach(self, head: int) -> None:
        """The master says it applied up to `head`: fetch the tail if we have not. A lost last event has no later
        event to reveal its gap, so without this a quiet cluster leaves a follower behind until the next one."""
        if head < self._order.next_idx:
            return
        async with self._fetch_lock:
            if head >= self._order.next_idx:
                await self._fetch_tail()

    async def fill_gap(self) -> None:
        """Fetch what is missing before the earliest buffered event, or from the snapshot if too old."""
        async with self._fetch_lock:
            gap = self._order.missing()
            if gap is None:
                return
            try:
                await self._fetch(gap[0], gap[1])
            except TooOld:
                await self._load_snapshot()
                await self._fetch(self._order.next_idx, None)

    def _accepts(self, event: IndexedEvent) -> bool:
        return self._master is not None and (event.master, event.term) == (self._master, self._term)

    def _on_message(self, key: str, payload: bytes) -> None:
        try:
            event = IndexedEvent.model_validate_json(payload)
        except ValidationError:
            log.warning("dropping malformed event on %s", key)
            return
        if not self._accepts(event):
            return
        self._deliver(self._order.offer(event))
        if self._order.missing() is not None and (self._gap_task is None or self._gap_task.done()):
            self._gap_task = asyncio.get_running_loop().create_task(self._fill_after_wait())

    async def _fill_after_wait(self) -> None:
        """Give a late arrival a moment before asking the master: most gaps are reordering, not loss."""
        await asyncio.sleep(self._gap_wait_s)
        try:
            async with asyncio.timeout(5 * self._query_timeout_s):
                await self.fill_gap()
        except Exception as exc:
            log.warning("could not fill gap from %d: %s", self._order.next_idx, exc)

    async def _fetch(self, start: int, end: int | None) -> None:
        params = f"from={start}" + (f"&to={end}" if end is not None else "")
        payload = await self._query_one(range_key, params)
        events = [e for e in decode_range_reply(payload) if self._accepts(e)]
        self._deliver(self._order.offer_all(events))

    async def _load_snapshot(self, *, force: bool = False) -> None:
        state = State.model_validate_json(await self._query_one(snapshot_key, ""))
        snap_next = state.last_event_applied_idx + 1
        if snap_next < self._order.next_idx and not force:
            return  # we are already past it; the range fetch that follows covers the rest
        self._on_snapshot(state)
        self._deliver(self._order.reset(snap_next, backwards=force))

    async def _query_one(self, key_of: Callable[[NodeId], str], params: str) -> bytes:
        """The first reply from the master we follow, retrying while none answers (it may be starting, or
        we may be about to follow another); the caller's timeout bounds the retries."""
        while True:
            master = self._master
            if master is not None:
                replies = await self._transport.query(key_of(master), params, timeout_s=self._query_timeout_s)
                if replies and master == self._master:
                    return replies[0]
            await asyncio.sleep(0.1)

    def _deliver(self, events: list[IndexedEvent]) -> None:
        for event in events:
            self._on_event(event)
