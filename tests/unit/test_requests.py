"""stream_error: which open streams a happening ends, and with what (a table), and Requests applying it."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from skulk.api.requests import MasterChanged, Requests, ShuttingDown, Silent, StreamError, WrongKind, stream_error
from skulk.cluster.payloads import PayloadBook
from skulk.cluster.transport import Transport
from skulk.types.chunks import ErrorChunk, TokenChunk
from skulk.types.commands import CancelCommand, Command
from skulk.types.errors import ErrorCode
from skulk.types.events import InstanceDeleted, TaskCreated, TaskFailed, TaskStatusUpdated
from skulk.types.ids import CommandId, InstanceId, NodeId, TaskId
from skulk.types.state import State
from skulk.types.tasks import TaskStatus

from .factories import QuietTransport, applied, chat_task

STATE = applied(TaskCreated(task=chat_task("t1", command_id="c1")))
C1, OTHER = CommandId("c1"), CommandId("c9")

CASES: list[tuple[str, object, StreamError | None]] = [
    ("a retryable task failure ends its command's stream",
     TaskFailed(task_id=TaskId("t1"), error_message="node n2 was lost; retry", retryable=True),
     StreamError(C1, ErrorCode.task_failed, "node n2 was lost; retry")),
    ("a final failure is the runner's to tell (it sends its own ErrorChunk)",
     TaskFailed(task_id=TaskId("t1"), error_message="bad prompt", retryable=False), None),
    ("a failure of an unknown task ends nothing",
     TaskFailed(task_id=TaskId("t404"), error_message="gone", retryable=True), None),
    ("a cancelled task ends its stream",
     TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Cancelled),
     StreamError(C1, ErrorCode.cancelled, "the request was cancelled")),
    ("a running task ends nothing", TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Running), None),
    ("an unrelated event ends nothing", InstanceDeleted(instance_id=InstanceId("inst")), None),
    ("a new master ends every stream",
     MasterChanged(NodeId("n2"), 3),
     StreamError(None, ErrorCode.session_changed,
                 "the cluster session changed (new master n2, term 3); retry the request")),
    ("no master (rejoining) ends every stream too",
     MasterChanged(None, 4),
     StreamError(None, ErrorCode.session_changed,
                 "the cluster session changed (new master none, term 4); retry the request")),
    ("shutting down ends every stream",
     ShuttingDown(),
     StreamError(None, ErrorCode.node_shutting_down,
                 "this node is shutting down; retry the request (another node, or this one once it is back)")),
    ("no first chunk from an instance silent for everyone: not ready",
     Silent(model="m", first=True, waited_s=120.0),
     StreamError(OTHER, ErrorCode.instance_not_ready,
                 "the instance for m reports ready but produced nothing for any request in 120 s; retry shortly")),
    ("no next chunk from an instance silent for everyone: a timeout",
     Silent(model="m", first=False, waited_s=300.0),
     StreamError(OTHER, ErrorCode.timeout,
                 "no token for 300 s and the instance for m produced nothing for any request; retry the request")),
    ("vectors on a chat's key", WrongKind(wanted="text"),
     StreamError(OTHER, ErrorCode.internal_error, "the instance answered with embeddings, not text")),
    ("text on an embedding's key", WrongKind(wanted="vectors"),
     StreamError(OTHER, ErrorCode.internal_error, "the instance answered with text, not vectors")),
]


@pytest.mark.parametrize(("why", "happening", "expected"), CASES, ids=[c[0] for c in CASES])
def test_stream_error(why: str, happening: object, expected: StreamError | None) -> None:
    assert stream_error(STATE, happening, OTHER) == expected  # type: ignore[arg-type]


def test_statuses_come_from_the_codes() -> None:
    chunk = StreamError(C1, ErrorCode.session_changed, "m").chunk(C1)
    assert chunk.status == 503 and chunk.retryable
    assert StreamError(C1, ErrorCode.timeout, "m").chunk(C1).status == 504


def _requests(sent: list[Command]) -> tuple[Requests, QuietTransport]:
    transport = QuietTransport()
    quiet = cast(Transport, transport)
    return Requests(quiet, PayloadBook(quiet, NodeId("n1")), sent.append), transport


async def test_requests_end_the_streams_a_happening_names_and_keep_the_others() -> None:
    sent: list[Command] = []
    requests, _ = _requests(sent)
    mine, other = requests.open(C1), requests.open(OTHER)
    requests.react(STATE, TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Cancelled))
    ended = await mine.next(1.0)
    assert isinstance(ended, ErrorChunk) and ended.code is ErrorCode.cancelled
    with pytest.raises(TimeoutError):
        await other.next(0.05)
    requests.react(State(), MasterChanged(NodeId("n2"), 2))
    assert (await other.next(1.0)).code is ErrorCode.session_changed  # type: ignore[union-attr]


async def test_chunks_for_an_open_stream_go_straight_in_and_others_over_the_data_plane() -> None:
    sent: list[Command] = []
    requests, transport = _requests(sent)
    stream = requests.open(C1)
    requests.deliver(TokenChunk(command_id=C1, token_id=1, text="hi"))
    requests.deliver(TokenChunk(command_id=OTHER, token_id=2, text="elsewhere"))
    assert (await asyncio.wait_for(stream.next(), 1.0)).text == "hi"  # type: ignore[union-attr]
    assert [key for key, _ in transport.puts] == [f"data/{OTHER}"]


async def test_cancel_sends_a_cancel_and_closes() -> None:
    sent: list[Command] = []
    requests, _ = _requests(sent)
    stream = requests.open(C1)
    requests.cancel(stream)
    assert requests.open_count == 0
    assert [type(c) for c in sent] == [CancelCommand] and sent[0].target_command_id == C1  # type: ignore[union-attr]
    requests.close(stream)  # closing twice is harmless
