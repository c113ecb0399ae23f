"""Data plane: token chunks from the sampling rank's node to the API node that took the request.

Tokens never touch the master or the event log. A chunk goes on `data/<api node>/<command>`, which the API node
subscribed to once, at start, for all its requests (`Requests.start`): a zenoh subscriber declared per request
cost 0.13-0.4 ms of the loop before the command could go out, and its declaration and withdrawal went to every
peer, for each request (issue 43).

Nodes of the release before this (format version 1) subscribe and publish per request on `data/<command>`. So a
node that has heard one (`Transport.mixed_versions`) also publishes there, and its API also subscribes there per
request; a stream that hears a chunk on both keys keeps to the key its first chunk came on (each publisher keeps
to its keys, and zenoh keeps one publisher's order per key), so no chunk is taken twice.

A runner's engine step yields a chunk for each of its streams, and each went out as a put of its own: at 64
streams, 64 zenoh messages a step, each received, opened and validated on its own by the API node (issue 43). So
a step's chunks for one API node go as ONE message on `batches/<api node>` (`publish_step`), which the API node
subscribes to at start beside its chunk key. No node of an earlier release subscribes there, and one would read
`batch` as a command id under its chunk key, so the sender batches only where zenoh says the API node's session
subscribes to that key (`Transport.matched`, zenoh's matching status: a per-peer capability that needs no version
bump) and no node of another format is about; otherwise chunk by chunk as before. A stream's chunks keep to one
key while the API node's subscription stands, so zenoh's per-key order holds, and a chunk from a batch counts as
come on the stream's chunk key (the same route), so a switch between them never drops one as a copy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import TypeAdapter

from skulk.cluster.transport import Transport
from skulk.types.chunks import Chunk
from skulk.types.ids import CommandId, NodeId

_chunk_json = TypeAdapter(Chunk)


def data_key(command_id: str, origin: NodeId | None = None) -> str:
    """Where `command_id`'s chunks go: under the API node that took it, or (`origin` None) the per-request key of
    format version 1 and of commands that name no origin (a placement's refusal)."""
    return f"data/{command_id}" if origin is None else f"data/{origin}/{command_id}"


def node_data_key(node_id: NodeId) -> str:
    """Every chunk addressed to `node_id`'s requests (its one subscription)."""
    return f"data/{node_id}/*"


def publish_chunk(transport: Transport, chunk: Chunk, origin: NodeId | None = None) -> None:
    """`origin`: the API node that took the command, when known. The per-request key too where that is unknown or
    a peer of the previous format may be listening (a put no one subscribes to goes nowhere on the wire)."""
    payload = chunk.model_dump_json().encode()
    if origin is not None:
        transport.put(data_key(chunk.command_id, origin), payload)
    if origin is None or transport.mixed_versions:
        transport.put(data_key(chunk.command_id), payload)


def batch_key(node_id: NodeId) -> str:
    """One engine step's chunks for `node_id`'s requests, in one message (`publish_step`; module doc)."""
    return f"batches/{node_id}"


def encode_batch(chunks: Sequence[Chunk]) -> bytes:
    """A JSON list of the chunks, each as `publish_chunk` writes it."""
    return b"[" + b",".join(chunk.model_dump_json().encode() for chunk in chunks) + b"]"


_batch_json = TypeAdapter(list[Chunk])


def decode_batch(payload: bytes) -> list[Chunk]:
    """The chunks of a step batch (one validation for all of them); ValidationError for anything else."""
    return _batch_json.validate_json(payload)


def publish_step(transport: Transport, chunks: Sequence[Chunk], origin: NodeId) -> None:
    """A step's chunks for the API node `origin` (another node): one message where that node takes batches and
    every peer speaks our format, else each chunk as `publish_chunk` sends it (module doc)."""
    if not transport.mixed_versions and transport.matched(batch_key(origin)):
        transport.put(batch_key(origin), encode_batch(chunks))
        return
    for chunk in chunks:
        publish_chunk(transport, chunk, origin)


class ChunkStream:
    """The API side of one command: chunks in arrival order, plus errors injected from cluster state."""

    def __init__(
        self,
        transport: Transport,
        command_id: CommandId,
        tap: Callable[[Chunk], None] | None = None,
        *,
        subscribe: bool = True,
    ) -> None:
        """`subscribe`: declare this command's own per-request subscription (`data_key(command_id)`); without it,
        the stream hears only what its owner hands it (`receive`, `inject`)."""
        self.command_id = command_id
        self._transport = transport
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self._tap = tap
        """Sees every chunk this stream sees (the event log's O(1) append); must never block."""
        self.heard_at: float | None = None
        """When the stream last received a chunk (monotonic): api/patience.py tells a queued request on a busy
        instance from one on a silent instance by it."""
        self._sub: Any = transport.subscribe(data_key(command_id), self._on_message) if subscribe else None
        self._via: str | None = None
        """The key the first chunk from the data plane came on; chunks on another are copies (module doc)."""

    def _on_message(self, key: str, payload: bytes) -> None:
        self.receive(key, payload)

    def receive(self, key: str, payload: bytes) -> None:
        """A chunk as it came over the data plane on `key` (validated here; a malformed one raises
        ValidationError)."""
        if self._via is not None and self._via != key:
            return
        self.take(_chunk_json.validate_json(payload), key)

    def take(self, chunk: Chunk, key: str) -> None:
        """A chunk already validated, as come on `key` (a step batch's chunk: as come on its chunk key)."""
        if self._via != key:
            if self._via is not None:
                return
            self._via = key
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
