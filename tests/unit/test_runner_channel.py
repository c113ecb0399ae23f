"""The runner's pipes to its supervisor (runner.channel): messages whole and in order, never a half message, no
wait for an empty inbox, and a closed outbox that stops its senders."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection

import pytest

from skulk.runner.channel import PIPE_BYTES, Frames, Inbox, Letters, Mailbox, Outbox
from skulk.runner.messages import CancelTask, Heartbeat, Shutdown, StatusChanged, TaskEnded, Tokens
from skulk.types.chunks import TokenChunk
from skulk.types.ids import CommandId, TaskId
from skulk.types.runners import RunnerReady
from skulk.types.tasks import TaskStatus
from skulk.worker.supervisor import RunnerSupervisor, SupervisorCallbacks, _Reading

from .diagnostics_fakes import spec_for
from .factories import instance

pytestmark = pytest.mark.timeout(30)


def _messages() -> list[object]:
    chunk = TokenChunk(command_id=CommandId("c1"), text="hé", token_id=7, completion_tokens=3)
    return [Tokens([chunk]), Heartbeat(), TaskEnded(TaskId("t1"), CommandId("c1"), TaskStatus.Complete),
            Tokens([chunk] * 200)]


def _drain(reader: Connection) -> bytes:
    """Every byte waiting in the pipe now."""
    os.set_blocking(reader.fileno(), False)
    data = b""
    while True:
        try:
            data += os.read(reader.fileno(), 1 << 16)
        except BlockingIOError:
            return data


def test_messages_cross_the_pipe_whole_and_in_order_however_the_bytes_are_cut() -> None:
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    outbox = Outbox(writer)
    sent = _messages()
    for message in sent:
        outbox.put(message)  # type: ignore[arg-type]
    data = _drain(reader)
    for cut in (1, 3, 64, len(data)):  # a byte at a time, odd sizes, all at once
        frames, got = Frames(), []
        for start in range(0, len(data), cut):
            got += frames.feed(data[start:start + cut])
        assert got == sent
    frames = Frames()
    assert frames.feed(data[:-1]) == sent[:-1]  # the last message half there: nothing of it yet
    assert frames.feed(data[-1:]) == sent[-1:]
    outbox.close()
    with pytest.raises(OSError):
        outbox.put(Heartbeat())  # the heartbeat thread stops on this
    reader.close()


def test_a_frame_is_a_plain_pickle_without_a_forking_pickler_per_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from multiprocessing.reduction import ForkingPickler

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a ForkingPickler was built for a message")

    monkeypatch.setattr(ForkingPickler, "__init__", refused)
    reader, writer = mp.Pipe(duplex=False)
    outbox = Outbox(writer)
    for message in _messages():
        outbox.put(message)  # type: ignore[arg-type]
    assert Frames().feed(_drain(reader)) == _messages()


def test_unread_bytes_are_seen_without_reading_them() -> None:
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    reading = _Reading(None, reader)
    assert not reading.unread()
    Outbox(writer).put(Heartbeat())
    assert reading.unread() and reading.unread()  # looking does not consume
    assert Frames().feed(_drain(reader)) == [Heartbeat()]
    reader.close()
    assert not reading.unread()  # a closed pipe reads as nothing, never raises


def test_the_inbox_hands_messages_over_in_order_and_an_empty_one_costs_no_wait() -> None:
    source = mp.get_context("spawn").Queue()
    inbox = Inbox(source)
    started = time.monotonic()
    assert inbox.take() == []
    assert inbox.take(0.01) == []
    assert time.monotonic() - started < 5
    sent = [CancelTask(TaskId(f"t{i}")) for i in range(5)] + [Shutdown()]
    for message in sent:
        source.put(message)
    got = inbox.take(10)  # waits for the first; whatever else is there comes with it
    while len(got) < len(sent):
        got += inbox.take(10)
    assert got == sent


async def test_tokens_overtake_the_bookkeeping_and_the_bookkeeping_keeps_its_order() -> None:
    """A step's tokens reach their streams as soon as they are read; what the runner said beside them (its status,
    a task's end) follows a moment later, in the order it was sent, so a first token's write to its client never
    waits behind the events that bookkeeping sends (issue 43). A pipe that ends hands over everything at once."""
    seen: list[object] = []
    done = asyncio.Event()

    def ended(message: TaskEnded) -> None:
        seen.append(message)
        done.set()

    callbacks = SupervisorCallbacks(on_status=seen.append, on_chunks=seen.extend, on_task_started=seen.append,
                                    on_task_ended=ended)
    supervisor = RunnerSupervisor(spec_for(instance(), "n1"), callbacks)
    supervisor._loop = asyncio.get_running_loop()
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    first, second = (TokenChunk(command_id=CommandId(c), text=c, token_id=1, completion_tokens=1) for c in "ab")
    end = TaskEnded(TaskId("t1"), CommandId("a"), TaskStatus.Complete)
    outbox = Outbox(writer)
    for message in (Tokens([first]), StatusChanged(RunnerReady()), Heartbeat(), end, Tokens([second])):
        outbox.put(message)  # type: ignore[arg-type]
    reading = _Reading(None, reader)
    supervisor._relay(reading, _drain(reader))
    assert seen == [first, second]  # both tokens at once, the bookkeeping not yet
    await asyncio.wait_for(done.wait(), 5)
    assert seen == [first, second, RunnerReady(), end]
    outbox.put(StatusChanged(RunnerReady()))  # type: ignore[arg-type]
    outbox.put(Tokens([first]))  # type: ignore[arg-type]
    supervisor._relay(reading, _drain(reader))
    supervisor._drain(reading)  # what _end_reading does before the exit is reported: all of it, now
    assert seen[4:] == [first, RunnerReady()] and reading.drain is None
    outbox.close()
    reader.close()


async def test_the_mailbox_never_blocks_the_loop_and_keeps_order_when_the_pipe_is_full() -> None:
    """The node's loop writes a runner's inbox itself (no feeder thread between it and the pipe, issue 43): a
    message the pipe has no room for waits in the mailbox, the ones after it queue behind it, and the loop's writer
    callback sends them on once the runner reads; the runner's end reads them whole and in order."""
    letters_end, mail_end = mp.get_context("spawn").Pipe(duplex=False)
    mailbox = Mailbox(mail_end)
    big = CancelTask(TaskId("x" * (4 * PIPE_BYTES)))  # larger than any pipe buffer
    sent = [CancelTask(TaskId("first")), big, Shutdown(), CancelTask(TaskId("last"))]
    for message in sent:
        mailbox.put(message)  # returns at once: nobody reads yet
    assert mailbox.waiting > 0
    letters = Letters(letters_end)
    got = await asyncio.wait_for(asyncio.to_thread(lambda: [letters.get() for _ in sent]), 20)
    assert got == sent
    assert mailbox.waiting == 0
    mailbox.close()
    mailbox.put(Shutdown())  # after close: dropped, never written to whatever file took the descriptor
    with pytest.raises(EOFError):
        letters.get()
    letters_end.close()


def test_a_mailbox_whose_runner_is_gone_drops_what_it_is_given() -> None:
    letters_end, mail_end = mp.get_context("spawn").Pipe(duplex=False)
    mailbox = Mailbox(mail_end)
    letters_end.close()
    mailbox.put(Shutdown())  # EPIPE: the supervisor's watch reports the exit, the send does not raise
    mailbox.close()


def test_a_spares_first_message_leaves_the_rest_for_the_inbox_in_order() -> None:
    """A spare reads its spec, then becomes a runner whose inbox thread reads on: messages that arrived in the same
    read as the spec are not lost."""
    letters_end, mail_end = mp.get_context("spawn").Pipe(duplex=False)
    mailbox = Mailbox(mail_end)
    sent = ["spec", CancelTask(TaskId("t1")), Shutdown()]
    for message in sent:
        mailbox.put(message)
    letters = Letters(letters_end)
    assert letters.get() == "spec"
    inbox = Inbox(letters)
    got = inbox.take(10)
    while len(got) < 2:
        got += inbox.take(10)
    assert got == sent[1:]
    mailbox.close()
