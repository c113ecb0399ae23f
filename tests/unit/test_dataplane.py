"""The API side of a command's chunk stream (cluster/dataplane.ChunkStream), on a real zenoh session."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from skulk.cluster.dataplane import ChunkStream, publish_chunk
from skulk.cluster.transport import Transport, TransportSettings
from skulk.types.chunks import TokenChunk
from skulk.types.ids import CommandId

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def transport() -> AsyncIterator[Transport]:
    t = Transport(TransportSettings(cluster=f"dp{uuid.uuid4().hex[:8]}", listen=["tcp/127.0.0.1:0"], multicast=False))
    t.open()
    try:
        yield t
    finally:
        t.close()


async def test_a_cancel_that_lands_as_a_chunk_arrives_is_not_dropped(transport: Transport) -> None:
    """unless_disconnected cancels a non-streaming request's reader when its client leaves; on a fast stream a
    chunk is nearly always arriving then. The cancel must still raise (with wait_for on Python 3.11 the reader
    returned the chunk instead and the request ran to its last token), and the chunk must stay queued."""
    stream = ChunkStream(transport, CommandId("c1"))
    try:
        reader = asyncio.ensure_future(stream.next(10))
        await asyncio.sleep(0)  # the reader now waits on the empty queue
        chunk = TokenChunk(command_id=CommandId("c1"), text="a", token_id=1, completion_tokens=1)
        stream.inject(chunk)  # wakes the reader...
        reader.cancel()  # ...and the cancel lands in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert await stream.next(1) == chunk
    finally:
        stream.close()


async def test_next_times_out_on_a_silent_stream(transport: Transport) -> None:
    stream = ChunkStream(transport, CommandId("c2"))
    try:
        with pytest.raises(TimeoutError):
            await stream.next(0.05)
    finally:
        stream.close()


async def test_queued_chunks_come_in_order_then_an_empty_stream_times_out(transport: Transport) -> None:
    """Chunks already queued are taken at once (no timer), in arrival order, whether injected in-process or put
    on the data plane; once drained the stream waits again and its timeout still fires."""
    stream = ChunkStream(transport, CommandId("c3"))
    try:
        chunks = [TokenChunk(command_id=CommandId("c3"), text=t, token_id=i, completion_tokens=i + 1)
                  for i, t in enumerate("abc")]
        stream.inject(chunks[0])
        stream.inject(chunks[1])
        assert [await stream.next(0), await stream.next(0)] == chunks[:2]
        publish_chunk(transport, chunks[2])
        assert await stream.next(5) == chunks[2]
        with pytest.raises(TimeoutError):
            await stream.next(0.05)
    finally:
        stream.close()
