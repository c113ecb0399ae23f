"""The runner's two pipes to its supervisor, kept off the per-step path: no thread hop, no syscall to find no mail.

With `multiprocessing.Queue` both ways, every token of a single stream crossed three threads beyond the runner's
loop: the queue's feeder thread in the runner (woken by `put`, to pickle and write while the loop waits for the
GIL back), then the supervisor's reader thread in the node (its `get` with a timeout builds a selector and takes a
lock per message), then the node's event loop (woken through its self-pipe); and the loop's `get_nowait` polled
the inbox pipe every step. With the runner and its node on one core, each hop is a context switch on the token's
critical path. Now:
- the inbox: a thread of the runner's own blocks on the queue and hands its messages over in memory, so an empty
  inbox costs the loop one in-memory check;
- the outbox: a plain pipe; a message is pickled and written whole (length, then pickle) by the thread that sends
  it (the loop, or the heartbeat thread) under a lock, and the node's event loop reads the pipe itself
  (`Frames`, worker/supervisor.py).
Measured (SmolLM2, one stream, runner and node on one core, `bench/node_path.py --streams 1 --cores 0/1` with the
loop timed by thread CPU clocks; 2-core VM, load about 1): the runner's CPU per step outside `engine.step()` went
from 0.23-0.24 ms (0.13 on the loop's thread, 0.10 on the others: the feeder) to 0.13-0.16 (0.003 on the others);
the sampling rank of Pipeline 2, 0.28-0.29 -> 0.21-0.22 ms.
A full pipe would hold the sender: the node's loop must then have stopped reading for thousands of steps, and the
pipe is widened (Linux: 1 MiB) so that a loop busy for seconds is absorbed long before that.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import queue
import struct
import threading
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from multiprocessing.reduction import ForkingPickler
from typing import Any

from skulk.runner.messages import FromRunner, ToRunner

PIPE_BYTES = 1 << 20
"""The outbox pipe's buffer where the kernel lets it be set (Linux F_SETPIPE_SZ; elsewhere the default)."""
_LENGTH = struct.Struct("!I")
"""Each message on the outbox pipe: its pickle's length, then the pickle (Frames reads them back)."""


class Inbox:
    """What the supervisor sends, handed over in memory by a daemon thread that blocks on the queue."""

    def __init__(self, source: Queue[ToRunner]) -> None:
        self._local: queue.SimpleQueue[ToRunner] = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(source,), name="inbox", daemon=True).start()

    def _pump(self, source: Queue[ToRunner]) -> None:
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
        payload = ForkingPickler.dumps(message)
        frame = memoryview(_LENGTH.pack(len(payload)) + payload)
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
