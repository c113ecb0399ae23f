"""The runner's two pipes to its supervisor, kept off the per-step path: no thread hop, no syscall to find no mail.

With `multiprocessing.Queue` both ways, every token of a single stream crossed three threads beyond the runner's
loop: the queue's feeder thread in the runner (woken by `put`, to pickle and write while the loop waits for the
GIL back), then the supervisor's reader thread in the node (its `get` with a timeout builds a selector and takes a
lock per message), then the node's event loop (woken through its self-pipe); and the loop's `get_nowait` polled
the inbox pipe every step. With the runner and its node on one core, each hop is a context switch on the token's
critical path. Now both ways are plain pipes of length-prefixed pickles:
- the inbox: the node's event loop writes each message itself, never blocking (`Mailbox`: what a full pipe does
  not take waits for the loop's writer callback, in order); a thread of the runner's own blocks on the pipe and
  hands its messages over in memory, so an empty inbox costs the loop one in-memory check. A `Queue` here put
  its feeder thread between the node's loop and the pipe: a task's message waited for the GIL the busy loop held,
  417 us from `put` to the runner's loop against 134 us for the plain pipe (issue 43, the time to first token);
- the outbox: a message is pickled and written whole (length, then pickle) by the thread that sends it (the loop,
  or the heartbeat thread) under a lock, and the node's event loop reads the pipe itself (`Frames`,
  worker/supervisor.py).
Measured (SmolLM2, one stream, runner and node on one core, `bench/node_path.py --streams 1 --cores 0/1` with the
loop timed by thread CPU clocks; 2-core VM, load about 1): the runner's CPU per step outside `engine.step()` went
from 0.23-0.24 ms (0.13 on the loop's thread, 0.10 on the others: the feeder) to 0.13-0.16 (0.003 on the others);
the sampling rank of Pipeline 2, 0.28-0.29 -> 0.21-0.22 ms.
A full pipe would hold the sender: the node's loop must then have stopped reading for thousands of steps, and the
pipe is widened (Linux: 1 MiB) so that a loop busy for seconds is absorbed long before that.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import os
import pickle
import queue
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any, Protocol

from skulk.runner.messages import FromRunner, ToRunner

PIPE_BYTES = 1 << 20
"""The outbox pipe's buffer where the kernel lets it be set (Linux F_SETPIPE_SZ; elsewhere the default)."""
_LENGTH = struct.Struct("!I")
"""Each message on either pipe: its pickle's length, then the pickle (Frames reads them back)."""
READ_BYTES = 1 << 16
"""What one read of a pipe takes at most."""


class Source(Protocol):
    """Where the runner's messages come from: one at a time, blocking; EOFError once the sender is gone."""

    def get(self) -> Any: ...


def _frame(message: object) -> bytes:
    """The message as one frame: plain pickle (messages.py: small, picklable, no I/O). ForkingPickler, a
    multiprocessing.Queue's pickler, built a pickler with a copied dispatch table for every message: py-spy put
    it at 5 % of a Pipeline's sampling runner's own Python time, 8 streams micro-batched (a Tokens message of 4
    chunks: 94 against 55 us; issue 43)."""
    payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


class Mailbox:
    """The node's end of a runner's inbox pipe, written from the event loop and never blocking it: a message the
    pipe has no room for (a long prompt, a runner that stopped reading) waits here, and the loop's writer callback
    sends it on, the later messages behind it. Once the runner is gone its messages are dropped: its exit is
    reported by the supervisor's watch, which fails what it held."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._fd = connection.fileno()
        widen(connection)
        os.set_blocking(self._fd, False)
        self._waiting = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def put(self, message: object) -> None:
        if self._closed:  # its descriptor may be another file's by now
            return
        frame = _frame(message)
        if self._waiting:
            self._waiting += frame
            return
        try:
            sent = os.write(self._fd, frame)
        except BlockingIOError:
            sent = 0
        except OSError:  # the runner is gone (BrokenPipeError)
            return
        if sent < len(frame):
            self._waiting += frame[sent:]
            self._await_room()

    def _await_room(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (a stop at exit): wait for the room here
            self._flush_blocking()
            return
        self._loop.add_writer(self._fd, self._flush)

    def _flush(self) -> None:
        """Loop: the pipe has room again."""
        try:
            sent = os.write(self._fd, self._waiting)
        except BlockingIOError:
            return
        except OSError:
            sent = len(self._waiting)
        del self._waiting[:sent]
        if not self._waiting and self._loop is not None:
            self._loop.remove_writer(self._fd)
            self._loop = None

    def _flush_blocking(self) -> None:
        os.set_blocking(self._fd, True)
        try:
            while self._waiting:
                del self._waiting[:os.write(self._fd, self._waiting)]
        except OSError:
            self._waiting.clear()
        finally:
            os.set_blocking(self._fd, False)

    @property
    def waiting(self) -> int:
        """Bytes the pipe has not taken yet."""
        return len(self._waiting)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.remove_writer(self._fd)
            self._loop = None
        self._waiting.clear()
        self._connection.close()


class Letters:
    """The runner's end of its inbox pipe: one message at a time, blocking (a spare's first message is its spec;
    from then on `Inbox`'s thread reads it)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._frames = Frames()
        self._ready: collections.deque[Any] = collections.deque()

    def get(self) -> Any:
        """The next message; EOFError once the node's end is closed."""
        while not self._ready:
            try:
                data = os.read(self._connection.fileno(), READ_BYTES)
            except OSError as exc:
                raise EOFError("the inbox pipe is closed") from exc
            if not data:
                raise EOFError("the node closed the inbox pipe")
            self._ready.extend(self._frames.feed(data))
        return self._ready.popleft()


class Inbox:
    """What the supervisor sends, handed over in memory by a daemon thread that blocks on the pipe."""

    def __init__(self, source: Source) -> None:
        self._local: queue.SimpleQueue[ToRunner] = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(source,), name="inbox", daemon=True).start()

    def _pump(self, source: Source) -> None:
        while True:
            try:
                message = source.get()
            except (EOFError, OSError, ValueError):  # the supervisor is gone; the parent watch ends the process
                return
            self._local.put(message)

    def take(self, timeout: float | None = None) -> list[ToRunner]:
        """Every message waiting, in order; with a timeout, wait up to that long for the first one."""
        local = self._local
        if local.empty():
            if timeout is None:
                return []
            try:
                first = local.get(timeout=timeout)
            except queue.Empty:
                return []
            messages = [first]
        else:
            messages = []
        while not local.empty():
            messages.append(local.get_nowait())
        return messages


class Outbox:
    """Messages to the supervisor, each pickled by its sender and written whole under a lock."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        widen(connection)

    def put(self, message: FromRunner) -> None:
        """Raises OSError once closed (the heartbeat thread stops on it)."""
        frame = memoryview(_frame(message))
        with self._lock:
            fd = self._connection.fileno()  # OSError once closed
            while frame:
                frame = frame[os.write(fd, frame):]

    def close(self) -> None:
        with self._lock:
            self._connection.close()


def widen(connection: Connection) -> None:
    """Ask the kernel for a PIPE_BYTES buffer; best effort (an unprivileged cap, or no F_SETPIPE_SZ)."""
    setpipe = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setpipe is None:
        return
    try:
        fcntl.fcntl(connection.fileno(), setpipe, PIPE_BYTES)
    except OSError:
        pass


class Frames:
    """The supervisor's side of the outbox pipe: bytes as they come, whole messages out. It never blocks on a
    message half written (a runner frozen mid-write leaves it waiting, not the node's event loop)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buffer += data
        messages: list[Any] = []
        start, size = 0, len(self._buffer)
        while size - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer, start)
            end = start + _LENGTH.size + length
            if end > size:
                break
            messages.append(pickle.loads(self._buffer[start + _LENGTH.size:end]))
            start = end
        del self._buffer[:start]
        return messages
