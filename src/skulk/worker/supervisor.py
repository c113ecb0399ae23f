"""One runner process: spawn it, feed it tasks, relay what it says, restart or fail it when it dies.

The supervisor lives on the node's event loop, which reads the runner's outbox pipe itself (runner.channel: a
token's message costs no thread hop on either side). It keeps the runner's local diagnostics (flight recorder,
milestones), never gossiped.

A runner heartbeats from a thread of its own; a watch thread of the supervisor's declares it hung when nothing
came for `hung_s` (counted from its first message, so spawn and imports never count; bytes the loop has not read
yet count as heard), kills it, and the exit is handled like a crash. A single-rank runner is restarted with
back-off while its budget lasts (`restart_budget` restarts within `restart_window_s`), then left failed; a
multi-rank one is restarted by the master, as a whole instance.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any

import psutil

from skulk import memory_limit
from skulk.diagnostics.clock import now_iso
from skulk.runner.channel import Frames, Mailbox
from skulk.runner.messages import (
    CancelTask,
    Footprint,
    FromRunner,
    Heartbeat,
    Records,
    RunTask,
    Shutdown,
    Spans,
    StatusChanged,
    TaskAccepted,
    TaskEnded,
    Tokens,
)
from skulk.runner.spec import RunnerSpec
from skulk.types.chunks import Chunk, ErrorChunk
from skulk.types.diagnostics import FlightRecorderEntry, Milestone
from skulk.types.errors import ErrorCode, clip_text
from skulk.types.ids import TaskId
from skulk.types.runners import RunnerFailed, RunnerIdle, RunnerPhase, RunnerStatus
from skulk.types.state import State
from skulk.types.tasks import Task, TaskStatus
from skulk.types.tracing import TraceSpan
from skulk.worker.oom import oom_evidence, oom_kills
from skulk.worker.spare import SpareRunner

log = logging.getLogger("skulk.supervisor")

FLIGHT_RECORDER_SIZE = 128
MILESTONES_KEPT = 32
RESTART_BACKOFF_S = 0.5  # doubled for each restart already inside the window
STOP_GRACE_S = 5.0
TERMINATE_GRACE_S = 2.0
REAP_WAIT_S = 1.0  # an exited child's code is stored within microseconds of its reaping, in whichever thread
READ_POLL_S = 0.2
"""How often the watch thread checks that the runner is alive and not hung."""
READ_BYTES = 1 << 16
"""The most the loop reads from a runner's pipe at once (it is called again while more waits)."""
BOOKKEEPING_AFTER_S = 0.003
"""How long what a runner says beside its tokens waits for the streams those tokens woke to write them (_relay):
a first token's way from delivery to the client's socket took 0.6-0.7 ms here, so 3 ms leaves it room on a
loaded machine and delays nothing anyone waits on (events the master orders anyway)."""


def limit_words() -> str:
    """The memory limit the kernel enforced on this runner, for an OOM's message (its cgroup's, else the RAM)."""
    group = memory_limit.this_cgroup()
    if group is not None and group.limit is not None:
        return f"whose memory limit is {group.limit / 1e9:.2f} GB (cgroup v{group.version})"
    return f"whose memory is {psutil.virtual_memory().total / 1e9:.2f} GB (the machine's RAM)"


def exit_cause(code: int | None, crash: str | None = None, oom: bool | None = None) -> str:
    """Why a runner process ended, in an operator's words: the exception it reported before exiting, or what
    its exit code means. SIGKILL is called out of memory only with evidence (`oom`: an OOM-kill counter went up
    while it ran, worker/oom.py); without it, the kill came from outside."""
    if crash:
        if "MemoryError" in crash or "OutOfMemory" in crash:
            return f"OOM ({crash})"
        return f"runner crashed: {crash}"
    if code == -signal.SIGKILL:
        if oom:
            return "OOM: killed by SIGKILL from the kernel's out-of-memory killer (an OOM kill was recorded)"
        if oom is None:
            return "killed by signal 9 (SIGKILL): from outside or out of memory (no OOM-kill counter is readable here)"
        return "killed by signal 9 (SIGKILL) from outside (no OOM kill was recorded while it ran)"
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return f"runner process killed by {name}"
    return f"runner process exited with code {code}"


@dataclass
class SupervisorCallbacks:
    on_status: Callable[[RunnerStatus], None]
    on_chunks: Callable[[Sequence[Chunk]], None]
    on_task_started: Callable[[TaskId], None]
    on_task_ended: Callable[[TaskEnded], None]
    on_gave_up: Callable[[str], None] | None = None
    """A single-rank runner spent its restart budget; the argument says why (for InstanceFailed)."""
    on_spans: Callable[[list[TraceSpan]], None] | None = None
    """Trace spans of traced tasks (runtime tracing), for the node's trace store."""
    on_footprint: Callable[[Footprint], None] | None = None
    """The warm runner's measured memory (its runtime overhead, for the node's info)."""


@dataclass
class SupervisorView:
    """Local, live facts about the runner for diagnostics."""

    status: RunnerStatus = field(default_factory=RunnerIdle)
    status_since: str = field(default_factory=now_iso)
    phase: RunnerPhase = "created"
    phase_started_at: str = field(default_factory=now_iso)
    phase_detail: str | None = None
    last_progress_at: str | None = None
    flight_recorder: deque[FlightRecorderEntry] = field(
        default_factory=lambda: deque(maxlen=FLIGHT_RECORDER_SIZE)
    )
    milestones: deque[Milestone] = field(default_factory=lambda: deque(maxlen=MILESTONES_KEPT))
    pending: dict[TaskId, Task] = field(default_factory=dict)
    in_progress: dict[TaskId, Task] = field(default_factory=dict)
    sent: set[TaskId] = field(default_factory=set)
    completed_count: int = 0
    cancelled: list[TaskId] = field(default_factory=list)
    last_task_sent_at: str | None = None
    last_event_received_at: str | None = None
    last_event_type: str | None = None
    exit_code: int | None = None


class _Reading:
    """One runner process's outbox pipe, as the loop reads it and the watch thread checks it."""

    def __init__(self, process: Any, outbox: Connection) -> None:
        self.process = process
        self.outbox = outbox
        self.frames = Frames()
        self.heard: float | None = None  # monotonic time of its last message (None: none yet)
        self.finished = threading.Event()  # set by the loop once the pipe is closed here
        self.backlog: deque[FromRunner] = deque()  # read, not yet handled (Supervisor._relay)
        self.drain: asyncio.TimerHandle | None = None  # the backlog's turn, once queued on the loop
        self.inbox: Mailbox | None = None  # the same process's inbox, closed with this pipe

    def unread(self) -> bool:
        """Bytes wait in the pipe (the loop has not read them yet); never raises."""
        try:
            return bool(select.select([self.outbox.fileno()], [], [], 0)[0])
        except (OSError, ValueError):
            return False


def exited(process: Any, timeout: float) -> bool:
    """Whether the process has exited, waiting up to timeout, without reaping it: its sentinel becomes readable
    at exit. is_alive() and join() reap (waitpid), and two threads reaping one child race: the loser gets
    ECHILD and reads the child as alive, with no exit code."""
    return bool(mp_wait([process.sentinel], timeout))


def exit_code(process: Any) -> int | None:
    """The exit code of a process that has exited (see exited): another thread may be between its waitpid and
    storing the code, so a missing code is read again for a moment rather than reported as None."""
    deadline = time.monotonic() + REAP_WAIT_S
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return code


def _deliver(loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], arg: Any) -> bool:
    """Hand arg to the loop; False once the loop is gone (the node has shut down)."""
    try:
        loop.call_soon_threadsafe(callback, arg)
    except RuntimeError:
        return False
    return True


def restart_delay(
    restarts: list[float], now: float, budget: int, window_s: float
) -> tuple[float | None, list[float]]:
    """Pure: the back-off before the next restart (None: the budget is spent) and the restarts still inside the
    window, to keep. The budget is over time, not a lifetime count: restarts older than the window are free."""
    recent = [t for t in restarts if now - t < window_s]
    if len(recent) >= budget:
        return None, recent
    return RESTART_BACKOFF_S * 2 ** len(recent), recent


class RunnerSupervisor:
    def __init__(
        self,
        spec: RunnerSpec,
        callbacks: SupervisorCallbacks,
        *,
        restart_budget: int = 3,
        restart_window_s: float = 60.0,
        hung_s: float = 15.0,
        restarts_locally: bool = True,
        spare: SpareRunner | None = None,
    ) -> None:
        self.spec = spec
        self.spare = spare
        """The node's spare runner, taken (when alive and of this runner's engine) instead of spawning."""
        self.restarts_locally = restarts_locally
        """False for an instance that backs a MetaInstance: the master retries it (RETRYING n/3), then re-places."""
        self.callbacks = callbacks
        self.view = SupervisorView()
        self.restart_budget = restart_budget
        self.restart_window_s = restart_window_s
        self.hung_s = hung_s
        self.restarts: list[float] = []  # monotonic times of the restarts inside the window
        self.restart_count = 0
        """Restarts over this supervisor's life (GET /metrics' skulk_runner_restarts_total)."""
        self._hung: str | None = None  # why the reader thread killed the current process
        self._oom_before: int | None = None
        self.stopping = False
        self._ctx = mp.get_context("spawn")
        self._process: Any = None
        self._inbox: Mailbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def runner_id(self) -> str:
        return self.spec.runner_id

    @property
    def _log_ids(self) -> dict[str, str]:
        """The ids structured logs carry for this runner's lines (structured_log)."""
        return {"runner_id": self.spec.runner_id, "instance_id": self.spec.instance_id}

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def milestone(self, name: str, detail: str | None = None) -> None:
        self.view.milestones.append(Milestone(at=now_iso(), name=name, detail=detail))

    def start(self) -> None:
        """Spawn the runner. Call from the event loop thread."""
        from skulk.runner.main import runner_main

        self._loop = asyncio.get_running_loop()
        self._hung = None
        self._oom_before = oom_kills()  # an OOM-kill counter, so a SIGKILL is called OOM only when it went up
        self.view.exit_code = None  # a fresh process: the previous one's exit code no longer describes it
        warm = self.spare.take(self.spec.engine) if self.spare is not None else None
        if warm is not None:  # the node's spare, its imports done: it becomes this runner
            self._process, self._inbox, outbox = warm.process, warm.inbox, warm.outbox
            self._send(self.spec)
            self.milestone("spawned", f"pid {self._process.pid} (the node's spare runner)")
        else:
            letters, mail = self._ctx.Pipe(duplex=False)  # both ways plain pipes: runner.channel says why
            outbox, pipe = self._ctx.Pipe(duplex=False)
            self._inbox = Mailbox(mail)
            self._process = self._ctx.Process(
                target=runner_main,
                args=(self.spec, letters, pipe, os.getpid()),
                name=f"skulk-runner-{self.runner_id[:8]}",
            )
            try:
                self._process.start()
            finally:
                pipe.close()  # the runner holds the write end now: its exit reads as the end of the pipe here
                letters.close()
            self.milestone("spawned", f"pid {self._process.pid}")
        reading = _Reading(self._process, outbox)
        reading.inbox = self._inbox
        os.set_blocking(outbox.fileno(), False)
        self._loop.add_reader(outbox.fileno(), self._on_readable, reading)
        threading.Thread(target=self._watch, args=(reading,), daemon=True).start()

    def _on_readable(self, reading: _Reading) -> None:
        """Loop: what the runner wrote, straight to its handler (no thread between the pipe and the loop)."""
        try:
            data = os.read(reading.outbox.fileno(), READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the runner's end is closed: it exited
            self._end_reading(reading)
            return
        reading.heard = time.monotonic()
        self._relay(reading, data)

    def _relay(self, reading: _Reading, data: bytes) -> None:
        """Loop: every whole message these bytes complete, heartbeats aside: tokens to their streams at once, the
        rest to the backlog, handled in order a moment later (_drain).

        What a runner says beside a step's tokens (the task's acceptance or end, its status, flight records and
        spans) turns into events to the master and back, 1.3-1.9 ms of a single node's loop (issue 43). Handled
        at once, it ran between a first token's delivery and the stream's write to its client (the response only
        starts in tasks scheduled after it). So tokens overtake that bookkeeping, never the other way round, and
        the bookkeeping keeps its own order."""
        for message in reading.frames.feed(data):
            if isinstance(message, Tokens):
                self._on_message(message)
            elif not isinstance(message, Heartbeat):
                reading.backlog.append(message)
        if reading.backlog and reading.drain is None:
            assert self._loop is not None
            reading.drain = self._loop.call_later(BOOKKEEPING_AFTER_S, self._drain, reading)

    def _drain(self, reading: _Reading) -> None:
        """Loop: the backlog's messages, in the order the runner sent them."""
        if reading.drain is not None:
            reading.drain.cancel()
            reading.drain = None
        backlog = reading.backlog
        while backlog:
            self._on_message(backlog.popleft())

    def _end_reading(self, reading: _Reading) -> None:
        """Loop: the pipe is done (or its runner is gone): read what is left, then let the watch thread end it."""
        if reading.finished.is_set():
            return
        while True:
            try:
                data = os.read(reading.outbox.fileno(), READ_BYTES)
            except OSError:  # BlockingIOError too: nothing more now, and the process is gone
                data = b""
            if not data:
                break
            self._relay(reading, data)
        self._drain(reading)  # all of it before the exit is reported
        assert self._loop is not None
        self._loop.remove_reader(reading.outbox.fileno())
        reading.outbox.close()
        if reading.inbox is not None:  # what it still held for the runner goes nowhere now
            reading.inbox.close()
        reading.finished.set()

    def _watch(self, reading: _Reading) -> None:
        """Watch thread: every READ_POLL_S, is the runner alive, and has it said anything (a heartbeat at least)
        within hung_s? Unread bytes count as heard: a busy event loop is not a hung runner. Once the pipe is
        done, wait for the process and report its exit to the loop."""
        loop = self._loop
        assert loop is not None
        process = reading.process
        while not reading.finished.wait(READ_POLL_S):
            if not process.is_alive():  # gone with its pipe still open (a child of it may hold the write end)
                if not _deliver(loop, self._end_reading, reading):
                    return
                while not reading.finished.wait(READ_POLL_S):
                    if loop.is_closed():
                        return
                break
            if reading.unread():
                reading.heard = time.monotonic()
            heard = reading.heard  # the hung clock starts with the first message: spawn time never counts
            if heard is not None and time.monotonic() - heard > self.hung_s and not self.stopping:
                self._kill_hung(process, time.monotonic() - heard)
                reading.heard = None
        process.join()
        _deliver(loop, self._on_exit, process)

    def _kill_hung(self, process: Any, silent_s: float) -> None:
        """Reader thread: the runner said nothing, not even a heartbeat, for hung_s: frozen. Kill it; its exit
        then fails its requests and restarts it like any crash."""
        self._hung = f"runner {self.runner_id[:8]} made no progress for {silent_s:.0f} s (hung) and was killed"
        log.warning("runner %s declared hung: silent for %.1f s (limit %.0f s), killing pid %s",
                    self.runner_id[:8], silent_s, self.hung_s, process.pid, extra=self._log_ids)
        process.kill()

    def _send(self, message: object) -> None:
        """To the runner's inbox, from the loop, never blocking it (channel.Mailbox)."""
        if self._inbox is None:
            raise RuntimeError(f"runner {self.runner_id[:8]} was never started")
        self._inbox.put(message)

    def send_task(self, task: Task) -> None:
        self.view.sent.add(task.task_id)
        self.view.pending[task.task_id] = task
        self.view.last_task_sent_at = now_iso()
        self._send(RunTask(task))

    def forget_finished(self, state: State) -> None:
        """Drop closed tasks from our books: a rank that is not the scheduler is never told about a task
        rank 0 rejected, and the ids of sent tasks must not grow without bound."""

        def closed(task_id: TaskId) -> bool:
            task = state.tasks.get(task_id)
            return task is None or not task.task_status.is_open

        view = self.view
        for task_id in [t for t in view.pending if closed(t)]:
            del view.pending[task_id]
        view.sent = {t for t in view.sent if not closed(t) or t in view.in_progress}

    def cancel(self, task_id: TaskId) -> None:
        if task_id in self.view.in_progress or task_id in self.view.pending:
            self._send(CancelTask(task_id))

    def _on_message(self, message: FromRunner) -> None:
        if self.stopping and isinstance(message, StatusChanged):
            return  # a runner being stopped no longer speaks for its runner id: a restart may reuse it
        view = self.view
        view.last_event_received_at = now_iso()
        view.last_event_type = type(message).__name__
        match message:
            case Tokens(chunks=chunks):
                self.callbacks.on_chunks(chunks)
            case StatusChanged(status=status):
                view.status, view.status_since = status, now_iso()
                self.milestone(type(status).__name__)
                self.callbacks.on_status(status)
            case TaskAccepted(task_id=task_id):
                task = view.pending.pop(task_id, None)
                if task is not None:
                    view.in_progress[task_id] = task
                elif self.spec.shard.device_rank == 0:  # closed while it waited in the scheduler's queue
                    self._send(CancelTask(task_id))
                    return
                self.callbacks.on_task_started(task_id)
            case TaskEnded():
                self._on_task_ended(message)
            case Records(entries=entries):
                self._on_records(entries)
            case Spans(spans=spans) if self.callbacks.on_spans is not None:
                self.callbacks.on_spans(spans)
            case Footprint() if self.callbacks.on_footprint is not None:
                self.callbacks.on_footprint(message)

    def _on_task_ended(self, ended: TaskEnded) -> None:
        self.view.in_progress.pop(ended.task_id, None)
        self.view.pending.pop(ended.task_id, None)
        if ended.status == TaskStatus.Complete:
            self.view.completed_count += 1
        elif ended.status == TaskStatus.Cancelled:
            self.view.cancelled = [*self.view.cancelled[-63:], ended.task_id]
        self.callbacks.on_task_ended(ended)

    def _on_records(self, entries: list[FlightRecorderEntry]) -> None:
        view = self.view
        for entry in entries:
            if entry.phase != view.phase:
                view.phase, view.phase_started_at = entry.phase, entry.at
            view.phase_detail = entry.detail or entry.event
            view.last_progress_at = entry.at
            view.flight_recorder.append(entry)

    def _on_exit(self, process: Any) -> None:
        if process is not self._process:
            return
        code = exit_code(process)
        self.view.exit_code = code
        self.milestone("exited", f"code {code}")
        if self.stopping:
            return
        crash = next((e.detail for e in reversed(self.view.flight_recorder) if e.event == "runner_crashed"), None)
        reason = self._hung or exit_cause(code, crash, oom_evidence(self._oom_before, oom_kills()))
        if reason.startswith("OOM"):
            reason += f" on node {self.spec.node_id[:8]}, {limit_words()}"
        log.warning("runner %s: %s", self.runner_id[:8], reason, extra=self._log_ids)
        delay, gave_up = None, None
        if self.spec.shard.world_size == 1 and self.restarts_locally:
            delay, self.restarts = restart_delay(self.restarts, time.monotonic(), self.restart_budget,
                                                 self.restart_window_s)
            if delay is None:
                gave_up = (f"{reason}; {len(self.restarts) + 1} failures within {self.restart_window_s:.0f} s, "
                           f"over the budget of {self.restart_budget} restarts: not restarted again")
        self._fail_open_tasks(reason + ("; it is being restarted" if delay is not None else ""))
        failed = RunnerFailed(error_message=gave_up or reason, at=datetime.now(UTC), attempt=self.spec.attempt)
        self.view.status, self.view.status_since = failed, now_iso()
        self.callbacks.on_status(failed)
        if delay is not None:
            self._schedule_restart(delay, reason)
        elif gave_up is not None:
            log.warning("runner %s failed for good: %s", self.runner_id[:8], gave_up, extra=self._log_ids)
            self.milestone("failed_for_good", clip_text(gave_up, 200))
            if self.callbacks.on_gave_up is not None:
                self.callbacks.on_gave_up(gave_up)

    def _schedule_restart(self, delay: float, reason: str) -> None:
        self.restarts.append(time.monotonic())
        self.restart_count += 1
        attempt = len(self.restarts)
        log.info("runner %s restarting in %.1f s (attempt %d of %d within %.0f s): %s", self.runner_id[:8],
                 delay, attempt, self.restart_budget, self.restart_window_s, reason, extra=self._log_ids)
        self.milestone("restarting", f"attempt {attempt} of {self.restart_budget}")
        assert self._loop is not None
        self._loop.call_later(delay, self._restart)

    def _restart(self) -> None:
        if not self.stopping:
            self.start()

    def _fail_open_tasks(self, reason: str) -> None:
        open_tasks = {**self.view.pending, **self.view.in_progress}
        for task in open_tasks.values():
            message = f"{reason}; retry the request"
            self.callbacks.on_chunks(
                [ErrorChunk(command_id=task.command_id, message=message, code=ErrorCode.task_failed, retryable=True)]
            )
            self._on_task_ended(TaskEnded(task.task_id, task.command_id, TaskStatus.Failed, message, retryable=True))

    async def stop(self) -> None:
        """Ask nicely, then terminate, then kill: no runner outlives its supervisor."""
        self.stopping = True
        process = self._process
        if process is None:
            return
        if not exited(process, 0):
            try:
                self._send(Shutdown())
            except (OSError, ValueError):
                pass
        for grace, escalate in ((STOP_GRACE_S, process.terminate), (TERMINATE_GRACE_S, process.kill)):
            if await asyncio.to_thread(exited, process, grace):
                break
            self.milestone("escalating", escalate.__name__)
            escalate()
        code = await asyncio.to_thread(exit_code, process) if await asyncio.to_thread(
            exited, process, TERMINATE_GRACE_S) else None
        self.view.exit_code = code
        self.milestone("stopped", f"code {code}")
