"""The API side of every request this node started: its stream of chunks, its prompt, its end.

`Requests` owns a request's life (start it with its payload, deliver its chunks, close it, cancel it); what ends
a stream early is decided by one pure function, `stream_error`, from the cluster's state and what happened
(a state event, a new master, a silent runner). Every error a stream carries that its runner did not send
itself comes from there."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from skulk.cluster.dataplane import (
    ChunkStream,
    batch_key,
    data_key,
    decode_batch,
    node_data_key,
    publish_chunk,
    publish_step,
)
from skulk.cluster.payloads import PayloadBook
from skulk.cluster.transport import Transport
from skulk.master.decide import session_changed_message
from skulk.types.chunks import Chunk, ErrorChunk
from skulk.types.commands import CancelCommand, Command
from skulk.types.errors import ErrorCode
from skulk.types.events import Event, TaskFailed, TaskStatusUpdated
from skulk.types.ids import CommandId, InstanceId, NodeId, new_id
from skulk.types.state import State
from skulk.types.tasks import TaskParams, TaskStatus
from skulk.types.waiting import WaitingOn

log = logging.getLogger(__name__)

FIRST_CHUNK_TIMEOUT_S = 120.0
"""How long a new request waits for its first chunk (a loading instance answers late, not never)."""
NEXT_CHUNK_TIMEOUT_S = 300.0
"""How long an open stream waits for its next chunk while its instance produces nothing for anyone."""
QUEUED_TIMEOUT_S = 900.0
"""How long a request waits while its instance serves others (queued behind them, or preempted): a busy
instance answers late, so this bound is long; api/patience.py decides which bound a silence is judged by."""


@dataclass(frozen=True, slots=True)
class MasterChanged:
    """A new (master, term), or master None while this node rejoins: every open stream's session is over."""

    master: NodeId | None
    term: int


@dataclass(frozen=True, slots=True)
class ShuttingDown:
    """This node stops serving (SIGTERM, SIGINT, a restart) and its streams' grace is over."""


@dataclass(frozen=True, slots=True)
class Silent:
    """A stream heard nothing for `waited_s`: before its first chunk (`first`) or between two; `on` is what it
    waited for (api/patience.py), `ahead` how many requests were ahead of it on its instance."""

    model: str
    first: bool
    waited_s: float
    on: WaitingOn = WaitingOn.silent_runner
    ahead: int = 0


@dataclass(frozen=True, slots=True)
class WrongKind:
    """A chunk of another kind than the request reads (vectors where a chat reads text)."""

    wanted: str


Happening = Event | MasterChanged | ShuttingDown | Silent | WrongKind


@dataclass(frozen=True, slots=True)
class StreamError:
    """What ends which streams: one command's, or every open one (`command_id` None)."""

    command_id: CommandId | None
    code: ErrorCode
    message: str

    def chunk(self, command_id: CommandId) -> ErrorChunk:
        return ErrorChunk(command_id=command_id, message=self.message, code=self.code)


def stream_error(state: State, happening: Happening, command_id: CommandId | None = None) -> StreamError | None:
    """Pure: the error a stream ends with because of `happening`, or None when it ends none. A state event
    names its task (the stream is the task's command); a silence or a wrong chunk names `command_id`'s."""
    match happening:
        case TaskFailed(retryable=True, task_id=task_id, error_message=message):
            task = state.tasks.get(task_id)
            return StreamError(task.command_id, ErrorCode.task_failed, message) if task else None
        case TaskStatusUpdated(task_status=TaskStatus.Cancelled, task_id=task_id):
            task = state.tasks.get(task_id)
            return StreamError(task.command_id, ErrorCode.cancelled, "the request was cancelled") if task else None
        case MasterChanged(master=master, term=term):
            return StreamError(None, ErrorCode.session_changed, session_changed_message(master or NodeId("none"), term))
        case ShuttingDown():
            return StreamError(None, ErrorCode.node_shutting_down, "this node is shutting down; retry the request "
                               "(another node, or this one once it is back)")
        case Silent():
            return StreamError(command_id, *_silence(happening))
        case WrongKind(wanted="text"):
            return StreamError(command_id, ErrorCode.internal_error, "the instance answered with embeddings, not text")
        case WrongKind():
            return StreamError(command_id, ErrorCode.internal_error, "the instance answered with text, not vectors")
        case _:
            return None


def _silence(silent: Silent) -> tuple[ErrorCode, str]:
    """Pure: the code and message of a stream ended by silence, naming what it waited for."""
    model, waited = silent.model, f"{silent.waited_s:.0f} s"
    match silent.on:
        case WaitingOn.unassigned:
            return ErrorCode.instance_not_ready, f"no instance of {model} took the request in {waited}; retry shortly"
        case WaitingOn.loading:
            return ErrorCode.instance_not_ready, (f"the instance for {model} is still loading after {waited}; "
                                                  "retry shortly")
        case WaitingOn.queue:
            return ErrorCode.timeout, (f"the request waited {waited} queued behind {silent.ahead} requests on the "
                                       f"instance for {model}, which is serving them; retry later")
    if silent.first:
        return ErrorCode.instance_not_ready, (f"the instance for {model} reports ready but produced nothing for any "
                                              f"request in {waited}; retry shortly")
    return ErrorCode.timeout, (f"no token for {waited} and the instance for {model} produced nothing for any "
                               "request; retry the request")


class Requests:
    """The open requests of this node's API: chunks addressed to this node go to their streams (one subscription
    for all, declared at start, so none is missed), a request's prompt stays here for the runners to fetch, and
    closing withdraws both."""

    def __init__(self, transport: Transport, payloads: PayloadBook, send: Callable[[Command], None], *,
                 tap: Callable[[Chunk], None] | None = None,
                 on_open: Callable[[CommandId], None] | None = None,
                 on_close: Callable[[CommandId], None] | None = None) -> None:
        self._transport = transport
        self._payloads = payloads
        self._send = send
        self._tap = tap
        self._on_open = on_open
        self._on_close = on_close
        self._streams: dict[CommandId, ChunkStream] = {}
        self._models: dict[CommandId, str] = {}
        """The model of each open request that carries a payload (a chat or an embedding; a placement has none)."""
        self._inbound: object | None = None

    def start(self) -> None:
        """Subscribe to the chunks addressed to this node's requests, one by one and in step batches
        (cluster/dataplane.py), once."""
        if self._inbound is None:
            node = self._payloads.node_id
            self._inbound = self._transport.subscribe(node_data_key(node), self._on_chunk)
            self._transport.subscribe(batch_key(node), self._on_batch)

    def _on_batch(self, _key: str, payload: bytes) -> None:
        """Loop: a runner's step of chunks for this node's commands (one message, one validation); each goes to
        its stream as come on its chunk key, and one whose request is closed is dropped."""
        try:
            chunks = decode_batch(payload)
        except ValidationError as exc:
            log.warning("dropped a malformed chunk batch from a peer: %s", exc.errors()[:1])
            return
        node = self._payloads.node_id
        for chunk in chunks:
            stream = self._streams.get(chunk.command_id)
            if stream is not None:
                stream.take(chunk, data_key(chunk.command_id, node))

    def _on_chunk(self, key: str, payload: bytes) -> None:
        """Loop: a chunk for one of this node's commands; one whose request is closed is dropped unread."""
        stream = self._streams.get(CommandId(key.rpartition("/")[2]))
        if stream is not None:
            stream.receive(key, payload)

    def open(self, command_id: CommandId, payload: TaskParams | None = None) -> ChunkStream:
        """The stream of `command_id`, and its payload offered to the runners; send the command after this. A
        command with a payload names this node as its origin, so its chunks come on this node's key; one without
        (a placement), or any while the cluster holds nodes of the previous format, also subscribes per request
        (cluster/dataplane.py)."""
        per_request = payload is None or self._transport.mixed_versions
        stream = ChunkStream(self._transport, command_id, self._tap, subscribe=per_request)
        self._streams[command_id] = stream
        if payload is not None:
            self._payloads.offer(command_id, payload)
            self._models[command_id] = payload.model
        if self._on_open is not None:
            self._on_open(command_id)
        return stream

    def deliver(self, chunk: Chunk, origin: NodeId | None = None) -> None:
        """A runner's chunk to its command's API node (`origin`, when known): straight into the stream when that
        is this node (a put and a subscription on our own zenoh session cost ~40 % of a single node's CPU per
        token, which it took from the runner on a 2-core machine), else over the data plane."""
        stream = self._streams.get(chunk.command_id)
        if stream is not None:
            stream.inject(chunk)
        else:
            publish_chunk(self._transport, chunk, origin)

    def deliver_step(self, chunks: Sequence[Chunk], origins: Mapping[CommandId, NodeId | None]) -> None:
        """A runner's step of chunks (`origins`: each command's API node, where known): this node's own straight
        into their streams, the rest in one message per API node where it takes batches (dataplane.publish_step),
        each in its step's order."""
        remote: dict[NodeId | None, list[Chunk]] = {}
        for chunk in chunks:
            stream = self._streams.get(chunk.command_id)
            if stream is not None:
                stream.inject(chunk)
            else:
                remote.setdefault(origins.get(chunk.command_id), []).append(chunk)
        for origin, group in remote.items():
            if origin is None:
                for chunk in group:
                    publish_chunk(self._transport, chunk)
            else:
                publish_step(self._transport, group, origin)

    def close(self, stream: ChunkStream) -> None:
        self._payloads.withdraw(stream.command_id)
        self._streams.pop(stream.command_id, None)
        self._models.pop(stream.command_id, None)
        stream.close()
        if self._on_close is not None:
            self._on_close(stream.command_id)

    def cancel(self, stream: ChunkStream) -> None:
        """The client is gone before the request finished: the task must not run on for nobody."""
        self._send(CancelCommand(command_id=CommandId(new_id()), target_command_id=stream.command_id))
        self.close(stream)

    def react(self, state: State, happening: Happening) -> None:
        """End the open streams `happening` ends (stream_error decides which, and with what)."""
        error = stream_error(state, happening)
        if error is None:
            return
        targets = list(self._streams.values()) if error.command_id is None else [
            s for s in (self._streams.get(error.command_id),) if s is not None]
        for stream in targets:
            stream.inject(error.chunk(stream.command_id))

    def heard_ago(self, state: State, instance_id: InstanceId, now: float | None = None) -> float | None:
        """Seconds since any open stream of `instance_id` on this node received a chunk; None: none has yet.
        Runs only when a stream's wait ran out, never per token."""
        on_instance = {t.command_id for t in state.tasks.values() if t.instance_id == instance_id}
        heard = [s.heard_at for c, s in self._streams.items() if c in on_instance and s.heard_at is not None]
        return (time.monotonic() if now is None else now) - max(heard) if heard else None

    def unheard(self) -> list[tuple[CommandId, str]]:
        """(command, model) of the open requests that have heard no chunk yet: the ones a runner may not have
        yet (GET /metrics reads them at scrape time, api/patience.py's `held_on` says what each waits for)."""
        streams = self._streams
        return [(c, m) for c, m in self._models.items() if (s := streams.get(c)) is not None and s.heard_at is None]

    @property
    def open_count(self) -> int:
        return len(self._streams)
