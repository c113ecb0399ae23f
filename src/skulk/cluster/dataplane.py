"""Data plane: token chunks on a per-command key, from the sampling rank's node to the API node.

Tokens never touch the master or the event log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter

from skulk.cluster.transport import Transport
from skulk.types.chunks import Chunk
from skulk.types.ids import CommandId

_chunk_json = TypeAdapter(Chunk)


def data_key(command_id: str) -> str:
    return f"data/{command_id}"


def publish_chunk(transport: Transport, chunk: Chunk) -> None:
    transport.put(data_key(chunk.command_id), chunk.model_dump_json().encode())


class ChunkStream:
    """The API side of one command: chunks in arrival order, plus errors injected from cluster state."""

    def __init__(
        self,
        transport: Transport,
        command_id: CommandId,
        tap: Callable[[Chunk], None] | None = None,
    ) -> None:
        self.command_id = command_id
        self._transport = transport
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self._tap = tap
        """Sees every chunk this stream sees (the event log's O(1) append); must never block."""
        self.heard_at: float | None = None
        """When the stream last received a chunk (monotonic): api/patience.py tells a queued request on a busy
        instance from one on a silent instance by it."""
        self._sub: Any = transport.subscribe(data_key(command_id), self._on_message)

    def _on_message(self, _key: str, payload: bytes) -> None:
        chunk = _chunk_json.validate_json(payload)
        self.heard_at = time.monotonic()
        if self._tap is not None:
            self._tap(chunk)
        self._queue.put_nowait(chunk)

    def inject(self, chunk: Chunk) -> None:
        self.heard_at = time.monotonic()
        if self._tap is not None:
            self._tap(chunk)
        self._queue.put_nowait(chunk)

    async def next(self, timeout: float | None = None) -> Chunk:
        """The next chunk; TimeoutError after `timeout` s. A cancel always raises here, even one that lands as a
        chunk arrives (Python 3.11's wait_for then returned the chunk and dropped the cancel, so a fast stream's
        abandoned non-streaming request ran to its last token for nobody); the chunk stays queued. A chunk already
        queued (a fast stream's usually is) is taken without arming a timer: py-spy put a quarter of the SSE
        path's time per token in arming and cancelling it."""
        if not self._queue.empty():
            return self._queue.get_nowait()
        async with asyncio.timeout(timeout):
            return await self._queue.get()

    def take_waiting(self) -> Chunk | None:
        """The next chunk if one was received and not read yet, else None (never waits)."""
        return None if self._queue.empty() else self._queue.get_nowait()

    @property
    def waiting(self) -> int:
        """Chunks received and not read yet."""
        return self._queue.qsize()

    def close(self) -> None:
        if self._sub is not None:
            self._transport.undeclare(self._sub)
            self._sub = None
