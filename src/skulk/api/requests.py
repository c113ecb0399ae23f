"""The API side of every request this node started: its stream of chunks, its prompt, its end.

`Requests` owns a request's life (start it with its payload, deliver its chunks, close it, cancel it); what ends
a stream early is decided by one pure function, `stream_error`, from the cluster's state and what happened
(a state event, a new master, a silent runner). Every error a stream carries that its runner did not send
itself comes from there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from skulk.cluster.dataplane import ChunkStream, publish_chunk
from skulk.cluster.payloads import PayloadBook
from skulk.cluster.transport import Transport
from skulk.master.decide import session_changed_message
from skulk.types.chunks import Chunk, ErrorChunk
from skulk.types.commands import CancelCommand, Command
from skulk.types.errors import ErrorCode
from skulk.types.events import Event, TaskFailed, TaskStatusUpdated
from skulk.types.ids import CommandId, NodeId, new_id
from skulk.types.state import State
from skulk.types.tasks import TaskParams, TaskStatus

FIRST_CHUNK_TIMEOUT_S = 120.0
"""How long a new request waits for its first chunk (a loading instance answers late, not never)."""
NEXT_CHUNK_TIMEOUT_S = 300.0
"""How long an open stream waits for its next chunk."""


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
    """A stream heard nothing for `waited_s`: before its first chunk (`first`) or between two."""

    model: str
    first: bool
    waited_s: float


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
        case Silent(first=True, model=model, waited_s=waited):
            return StreamError(command_id, ErrorCode.instance_not_ready,
                               f"the instance for {model} produced nothing in {waited:.0f} s; "
                               "it may still be loading, retry shortly")
        case Silent(waited_s=waited):
            return StreamError(command_id, ErrorCode.timeout, f"no token for {waited:.0f} s; retry the request")
        case WrongKind(wanted="text"):
            return StreamError(command_id, ErrorCode.internal_error, "the instance answered with embeddings, not text")
        case WrongKind():
            return StreamError(command_id, ErrorCode.internal_error, "the instance answered with text, not vectors")
        case _:
            return None


class Requests:
    """The open requests of this node's API: a command's stream subscribes before the command is sent (no chunk
    is missed), its prompt stays here for the runners to fetch, and closing withdraws both."""

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

    def open(self, command_id: CommandId, payload: TaskParams | None = None) -> ChunkStream:
        """The stream of `command_id`, and its payload offered to the runners; send the command after this."""
        stream = ChunkStream(self._transport, command_id, self._tap)
        self._streams[command_id] = stream
        if payload is not None:
            self._payloads.offer(command_id, payload)
        if self._on_open is not None:
            self._on_open(command_id)
        return stream

    def deliver(self, chunk: Chunk) -> None:
        """A runner's chunk to its command's API node: straight into the stream when that is this node (a put and
        a subscription on our own zenoh session cost ~40 % of a single node's CPU per token, which it took from
        the runner on a 2-core machine), else over the data plane."""
        stream = self._streams.get(chunk.command_id)
        if stream is not None:
            stream.inject(chunk)
        else:
            publish_chunk(self._transport, chunk)

    def close(self, stream: ChunkStream) -> None:
        self._payloads.withdraw(stream.command_id)
        self._streams.pop(stream.command_id, None)
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

    @property
    def open_count(self) -> int:
        return len(self._streams)
