"""Request payloads (prompts and sampling) travel point to point, never through the replicated state.

The API node that takes a request keeps its `ChatCompletionTaskParams` and answers zenoh queries for it on
`payload/<its node id>/<command id>`; the command to the master and the task in state carry only ids and the
model. A worker about to hand the task to its runner asks the origin node for the payload (one query, cached
per command so the ranks of one node share it); where that node is its own, it reads the book directly, with no
query and no serialization (a single node's every request: 0.5-0.7 ms of its time to first token, issue 43). A
payload is dropped when the API node closes the request's stream, and the book is bounded, so an abandoned
request cannot pin memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Container
from threading import Lock

from pydantic import ValidationError

from skulk.cluster.transport import Transport
from skulk.types.ids import CommandId, NodeId
from skulk.types.tasks import ChatCompletionTaskParams, EmbeddingTaskParams, Task, TaskParams, TextEmbedding

log = logging.getLogger(__name__)
MAX_HELD = 4096
"""Open requests one API node holds payloads for; the oldest goes first past this (its stream is long gone)."""
FETCH_TIMEOUT_S = 5.0


def payload_key(origin: str, command_id: str) -> str:
    return f"payload/{origin}/{command_id}"


class PayloadBook:
    """API side: the payloads of this node's open requests, served to the nodes that run them."""

    def __init__(self, transport: Transport, node_id: NodeId, limit: int = MAX_HELD) -> None:
        self._transport, self.node_id, self._limit = transport, node_id, limit
        self._held: OrderedDict[str, TaskParams] = OrderedDict()
        self._lock = Lock()  # answered on zenoh's threads, written on the loop

    def start(self) -> None:
        self._transport.serve(payload_key(self.node_id, "*"), self._answer)

    def offer(self, command_id: CommandId, params: TaskParams) -> None:
        """Hold a request's payload as it is (validated, immutable): serialized only when another node asks."""
        with self._lock:
            self._held[command_id] = params
            while len(self._held) > self._limit:
                self._held.popitem(last=False)

    def get(self, command_id: str) -> TaskParams | None:
        """This node's own runners' read of a payload (PayloadFetcher.local)."""
        with self._lock:
            return self._held.get(command_id)

    def withdraw(self, command_id: CommandId) -> None:
        with self._lock:
            self._held.pop(command_id, None)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _answer(self, key: str, _parameters: str) -> bytes | None:
        params = self.get(key.rsplit("/", 1)[-1])
        return None if params is None else params.model_dump_json().encode()


class PayloadFetcher:
    """Worker side: one query per command to its origin node, shared by this node's ranks; none where the origin
    is this node (`book`: the node's own PayloadBook)."""

    def __init__(self, transport: Transport, book: PayloadBook | None = None) -> None:
        self._transport, self._book = transport, book
        self._pending: dict[str, asyncio.Task[TaskParams | None]] = {}

    def local(self, task: Task) -> TaskParams | None:
        """The payload at once where this node took the request and still holds it (None: ask with fetch)."""
        book = self._book
        if book is None or task.origin_node_id != book.node_id:
            return None
        params = book.get(task.command_id)
        return params if isinstance(params, _params_type(task)) else None

    async def fetch(self, task: Task) -> TaskParams | None:
        if task.origin_node_id is None:
            return None
        pending = self._pending.get(task.command_id)
        if pending is None:
            query = self._query(task.origin_node_id, task.command_id, _params_type(task))
            pending = asyncio.get_running_loop().create_task(query)
            self._pending[task.command_id] = pending
        return await asyncio.shield(pending)

    def forget(self, open_commands: Container[str]) -> None:
        """Drop what was fetched for commands that are no longer open."""
        for command_id in [c for c in self._pending if c not in open_commands and self._pending[c].done()]:
            del self._pending[command_id]

    async def _query(
        self, origin: NodeId, command_id: CommandId, kind: type[TaskParams]
    ) -> TaskParams | None:
        replies = await self._transport.query(payload_key(origin, command_id), timeout_s=FETCH_TIMEOUT_S)
        for reply in replies:
            try:
                return kind.model_validate_json(reply)
            except ValidationError:
                log.warning("malformed payload for command %s from %s dropped", command_id[:8], origin[:8])
        return None


def _params_type(task: Task) -> type[TaskParams]:
    """The payload a task's kind carries: an embedding's texts or a chat's messages."""
    return EmbeddingTaskParams if isinstance(task, TextEmbedding) else ChatCompletionTaskParams
