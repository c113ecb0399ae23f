"""The API side of a command's chunk stream (cluster/dataplane.ChunkStream) and the keys chunks travel on, on a real
zenoh session."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from skulk.api.requests import Requests
from skulk.cluster.dataplane import ChunkStream, batch_key, data_key, encode_batch, publish_chunk
from skulk.cluster.payloads import PayloadBook
from skulk.cluster.transport import Transport, TransportSettings
from skulk.testing.nodes import free_port
from skulk.types import versions
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.chunks import TokenChunk
from skulk.types.ids import CommandId, ModelId, NodeId
from skulk.types.tasks import ChatCompletionTaskParams

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


def _params() -> ChatCompletionTaskParams:
    return ChatCompletionTaskParams(model=ModelId("m"), messages=[ChatMessage(role="user", content="hi")],
                                    sampling=SamplingParams())


async def _heard(stream: ChunkStream, timeout: float = 5) -> TokenChunk | None:
    try:
        return await stream.next(timeout)  # type: ignore[return-value]
    except TimeoutError:
        return None


async def test_a_requests_chunks_come_on_its_nodes_one_subscription_not_one_of_its_own(transport: Transport) -> None:
    """A chat names this node as its origin, so its chunks come under this node's key, on the subscription the
    node declared once at start: opening the request declares nothing (issue 43: 0.13-0.4 ms of the loop before
    the command went out, and a declaration to every peer). Chunks for another node's requests, or for a request
    already closed, reach no stream."""
    requests = Requests(transport, PayloadBook(transport, NodeId("n1")), lambda _: None)
    requests.start()
    declared = len(transport._declared)
    stream = requests.open(CommandId("k1"), _params())
    assert len(transport._declared) == declared  # nothing per request
    chunk = TokenChunk(command_id=CommandId("k1"), text="a", token_id=1, completion_tokens=1)
    publish_chunk(transport, chunk.model_copy(update={"text": "elsewhere"}), NodeId("n2"))
    publish_chunk(transport, chunk, NodeId("n1"))
    assert await _heard(stream) == chunk  # and not the one addressed to n2, which came first
    requests.close(stream)
    publish_chunk(transport, chunk, NodeId("n1"))  # closed: dropped unread
    placement = requests.open(CommandId("k2"))  # no payload, no origin: its own subscription, on the old key
    assert len(transport._declared) == declared + 1
    publish_chunk(transport, chunk.model_copy(update={"command_id": CommandId("k2")}))
    assert (await _heard(placement)) is not None
    requests.close(placement)


async def test_beside_nodes_of_the_previous_format_both_sides_use_the_per_request_key_too(
        transport: Transport) -> None:
    """A node of format version 1 subscribes per request on data/<command> and publishes only there: once this node
    has heard one, its requests subscribe there too and its chunks go there as well as on the origin's key. A
    stream that hears the same chunks on both keys keeps to the first key and takes each chunk once."""
    requests = Requests(transport, PayloadBook(transport, NodeId("n1")), lambda _: None)
    requests.start()
    transport.versions.met.add(versions.UNVERSIONED)
    stream = requests.open(CommandId("k3"), _params())
    old_node_hears: list[str] = []
    all_heard = asyncio.Event()

    def old_node(key: str, _payload: bytes) -> None:
        old_node_hears.append(key)
        if len(old_node_hears) == 3:
            all_heard.set()

    transport.subscribe(data_key(CommandId("k3")), old_node)
    chunks = [TokenChunk(command_id=CommandId("k3"), text=t, token_id=i, completion_tokens=i + 1)
              for i, t in enumerate("bcd")]
    for chunk in chunks:
        publish_chunk(transport, chunk, NodeId("n1"))
    assert [await _heard(stream) for _ in chunks] == chunks
    await asyncio.wait_for(all_heard.wait(), 5)
    assert old_node_hears == [data_key(CommandId("k3"))] * 3
    assert await _heard(stream, 0.3) is None  # no copies
    requests.close(stream)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Transport, Transport]]:
    """Two nodes' sessions on one cluster, the second connected to the first: the API node n1 and a worker's node
    n2 in these tests."""
    cluster, port = f"dp{uuid.uuid4().hex[:8]}", free_port()
    api = Transport(TransportSettings(cluster=cluster, listen=[f"tcp/127.0.0.1:{port}"], multicast=False))
    api.open()
    peer = Transport(TransportSettings(cluster=cluster, listen=["tcp/127.0.0.1:0"], multicast=False,
                                       bootstrap_peers=[f"tcp/127.0.0.1:{port}"]))
    peer.open()
    try:
        yield api, peer
    finally:
        peer.close()
        api.close()


async def _until(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    """Wait on zenoh's routing (a declaration reaching the peer) by polling its answer, bounded."""
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)
    assert check(), what


def _step(texts: dict[str, str], finished: frozenset[str] = frozenset()) -> list[TokenChunk]:
    return [TokenChunk(command_id=CommandId(c), text=t, token_id=ord(t[0]), completion_tokens=1,
                       finish_reason="length" if c in finished else None) for c, t in texts.items()]


def _spy(t: Transport, key: str) -> list[bytes]:
    heard: list[bytes] = []
    t.subscribe(key, lambda _k, payload: heard.append(payload))
    return heard


async def test_a_steps_chunks_for_another_node_go_as_one_message_and_every_stream_keeps_its_own(
        pair: tuple[Transport, Transport]) -> None:
    """Issue 43: a runner's step of chunks for three requests of another API node crosses as ONE message (not
    three), and each stream gets exactly its own chunks in order with its finish reason: streams of different
    lengths (k2 finishes at the first step), a request closed between steps (its later chunks dropped, the others
    untouched), and a chunk for a command the API node never opened (dropped)."""
    transport, peer = pair
    api = Requests(transport, PayloadBook(transport, NodeId("n1")), lambda _: None)
    api.start()
    streams = {c: api.open(CommandId(c), _params()) for c in ("k1", "k2", "k3")}
    batches, singles = _spy(peer, batch_key(NodeId("n1"))), _spy(peer, "data/n1/*")  # what n1 is sent
    worker = Requests(peer, PayloadBook(peer, NodeId("n2")), lambda _: None)
    await _until(lambda: peer.matched(batch_key(NodeId("n1"))), "n1's batch subscription to reach n2")
    origins = {CommandId(c): NodeId("n1") for c in ("k1", "k2", "k3", "zz")}
    worker.deliver_step(_step({"k1": "a", "k2": "b", "k3": "c"}, frozenset({"k2"})), origins)
    worker.deliver_step(_step({"k1": "d", "k3": "e", "zz": "x"}), origins)
    assert [(await _heard(streams["k1"])), (await _heard(streams["k1"]))] == [
        *_step({"k1": "a"}), *_step({"k1": "d"})]
    assert await _heard(streams["k2"]) == _step({"k2": "b"}, frozenset({"k2"}))[0]
    assert [await _heard(streams["k3"]), await _heard(streams["k3"])] == [*_step({"k3": "c"}), *_step({"k3": "e"})]
    api.close(streams["k3"])
    worker.deliver_step(_step({"k1": "f", "k3": "g"}, frozenset({"k1", "k3"})), origins)
    assert await _heard(streams["k1"]) == _step({"k1": "f"}, frozenset({"k1"}))[0]
    assert [await _heard(s, 0.2) for s in streams.values()] == [None] * 3  # nothing more, no copies
    assert len(batches) == 3 and singles == []  # what n2 put (its own session's spies hear it): a message a step


async def test_an_api_node_that_takes_no_batches_is_sent_chunk_by_chunk(pair: tuple[Transport, Transport]) -> None:
    """A node of an earlier release subscribes only to its chunk key (and would read `batch` as a command id):
    zenoh's matching status says it takes no batches, so its chunks go one by one as before and all arrive."""
    transport, peer = pair
    old_api = ChunkStream(transport, CommandId("k5"), subscribe=False)
    transport.subscribe("data/n1/*", lambda key, payload: old_api.receive(key, payload))
    worker = Requests(peer, PayloadBook(peer, NodeId("n2")), lambda _: None)
    await _until(lambda: peer.matched("data/n1/k5"), "n1's chunk subscription to reach n2")
    assert not peer.matched(batch_key(NodeId("n1")))
    chunks = _step({"k5": "a"}) + _step({"k5": "b"})
    worker.deliver_step(chunks, {CommandId("k5"): NodeId("n1")})
    assert [await _heard(old_api), await _heard(old_api)] == chunks


async def test_beside_a_node_of_another_format_no_batches_are_sent(pair: tuple[Transport, Transport]) -> None:
    """Once a node of the previous format is about (Transport.mixed_versions) chunks go one by one on both keys,
    as the module's rolling-upgrade rule says, even to an API node that takes batches; the stream takes each once."""
    transport, peer = pair
    api = Requests(transport, PayloadBook(transport, NodeId("n1")), lambda _: None)
    api.start()
    stream = api.open(CommandId("k6"), _params())
    worker = Requests(peer, PayloadBook(peer, NodeId("n2")), lambda _: None)
    await _until(lambda: peer.matched(batch_key(NodeId("n1"))), "n1's batch subscription to reach n2")
    peer.versions.met.add(versions.UNVERSIONED)
    chunks = _step({"k6": "a"}) + _step({"k6": "b"})
    worker.deliver_step(chunks, {CommandId("k6"): NodeId("n1")})
    assert [await _heard(stream), await _heard(stream)] == chunks
    assert await _heard(stream, 0.2) is None


async def test_a_malformed_batch_is_dropped_and_the_streams_go_on(pair: tuple[Transport, Transport]) -> None:
    """A hostile or broken peer's batch (not a list of chunks) is dropped with a warning; a good one after it is
    taken."""
    transport, peer = pair
    api = Requests(transport, PayloadBook(transport, NodeId("n1")), lambda _: None)
    api.start()
    stream = api.open(CommandId("k7"), _params())
    await _until(lambda: peer.matched(batch_key(NodeId("n1"))), "n1's batch subscription to reach n2")
    for bad in (b"{}", b"[{\"kind\": \"nope\"}]", b"\xff"):
        peer.put(batch_key(NodeId("n1")), bad)
    good = _step({"k7": "a"})
    peer.put(batch_key(NodeId("n1")), encode_batch(good))
    assert await _heard(stream) == good[0]
