"""The event log's writer: appends from any thread, one writer thread, retention and the free-space floor.

`append` only puts `(time, item)` on a deque (thread-safe, no lock, no I/O, no serialising), so neither the
event loop nor a zenoh thread carrying a token ever waits for the disk. The writer thread wakes every
`flush_every_s`, serialises the batch and writes it with one `write`.

Retention (runbook 004, numbers are `Limits`' defaults): past `max_bytes` the live file is ring-compacted to its
latest `keep_events` records and the older part becomes an archive; archives are dropped oldest first while
they hold more than `archive_max_bytes` in total or number more than `max_archives`. Every `check_every`
appends the free space of the log's volume is read; below `free_space_floor_bytes`, or when a write fails with
ENOSPC, the log goes counting-only (events are numbered and counted, never written; one CRITICAL line) and
writes again after a check finds room.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skulk.config import EventLogConfig, Settings
from skulk.eventlog import records
from skulk.types import versions
from skulk.types.versions import FileAction

log = logging.getLogger("skulk.eventlog")

MiB = 1024 * 1024
GiB = 1024 * MiB
LIVE_NAME = "events.jsonl"
PENDING_LIMIT = 1_000_000
"""Items waiting for the writer beyond this are dropped (and counted): a stuck disk must not eat the RAM."""


Limits = EventLogConfig
"""The log's limits are skulk.yaml's `event_log` section itself (one definition of the numbers and defaults)."""


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class EventLog:
    def __init__(
        self,
        directory: Path,
        limits: Limits | None = None,
        *,
        probe: Callable[[Path], int] = free_bytes,
        flush_every_s: float = 0.05,
    ) -> None:
        self.directory = directory
        self.limits = limits or Limits()
        self.path = directory / LIVE_NAME
        self.archive_dir = directory / "archive"
        self._probe = probe
        self._flush_every_s = flush_every_s
        self._pending: deque[tuple[float, Any]] = deque()
        self._lock = threading.Lock()  # the live file's identity and size: writer (compaction) vs readers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._size = 0
        self.seq = 0
        self.counting_only = False
        self.counting_reason: str | None = None
        self.refused: str | None = None
        """Why the live file is not written (a newer release's format, a migration that failed): counting only."""
        self.counted_only = 0
        self.dropped = 0
        self.torn_bytes_dropped = 0
        self.compactions = 0
        self._archive_bytes = 0
        self._drains = 0
        self._drained = threading.Condition()

    # -- any thread -----------------------------------------------------------------------------------------
    def append(self, item: Any) -> None:
        """A pydantic model (or JSON-able value) to log. O(1), never blocks, never raises."""
        if len(self._pending) < PENDING_LIMIT:
            self._pending.append((time.time(), item))
        else:
            self.dropped += 1

    @property
    def bytes_on_disk(self) -> int:
        return self._size + self._archive_bytes

    def status(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "mode": "counting_only" if self.counting_only else "writing",
            "countingOnlyReason": self.counting_reason,
            "lastSeq": self.seq,
            "countedNotWritten": self.counted_only,
            "dropped": self.dropped,
            "bytes": self.bytes_on_disk,
            "liveBytes": self._size,
            "archiveBytes": self._archive_bytes,
            "compactions": self.compactions,
            "tornBytesDroppedAtOpen": self.torn_bytes_dropped,
        }

    def read(self, since: int, limit: int) -> list[dict[str, Any]]:
        """Records with seq > since from the live file, oldest first. Blocking: call from a thread."""
        with self._lock:
            return records.read_after(self.path, self._size, since, limit)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything appended before the call has been written (or counted)."""
        with self._drained:
            target = self._drains + 2  # the drain running now may have started before the call
            return self._drained.wait_for(lambda: self._drains >= target, timeout)

    def first_seq(self) -> int | None:
        with self._lock:
            return records.first_seq(self.path) if self._size else None

    # -- lifecycle ------------------------------------------------------------------------------------------
    def open(self) -> None:
        """Recover the live file (drop a torn last record), then start the writer thread."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.archive_dir.mkdir(exist_ok=True)
        if self._bring_up_to_date():
            self._recover()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._check_space()
        # else a newer release's log: its file untouched and unread, the writer only counts
        self._thread = threading.Thread(target=self._run, name="skulk-eventlog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _bring_up_to_date(self) -> bool:
        """The live file in this release's record format (types/versions.py): an older one is copied to
        `events.jsonl.v<n>.bak` and rewritten (archives are closed history the node never reads back, and stay as
        written); False, the log counting only and the file left as it is, for a newer or unreadable one."""
        found = records.file_version(self.path)
        action = versions.file_action(found)
        if action is FileAction.refuse:
            self.refused = versions.file_refusal(str(self.path), found)
            self._enter_counting_only(self.refused)
            return False
        if action is FileAction.migrate:
            assert found is not None
            return self._migrate(found)
        return True

    def _migrate(self, found: int) -> bool:
        """Back the live file up and rewrite it record by record; a failure (no space for the copy) leaves the
        file as it was and the log counting only for this run."""
        backup = self.path.with_name(versions.backup_name(self.path.name, found))
        tmp = self.path.with_suffix(".migrating")
        try:
            shutil.copy2(self.path, backup)
            with self.path.open("rb") as src, tmp.open("wb") as dst:
                dst.writelines(records.migrate_line(line) for line in src)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            backup.unlink(missing_ok=True)
            self.refused = f"could not migrate {self.path} from format version {found}: {exc}"
            self._enter_counting_only(self.refused)
            return False
        log.warning("migrated the event log %s from format version %d to %d; the old file is kept as %s",
                    self.path, found, versions.FORMAT_VERSION, backup)
        return True

    def _recover(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        if tmp.exists() and not self.path.exists():  # killed between the two renames of a compaction
            os.rename(tmp, self.path)
        size = self.path.stat().st_size if self.path.exists() else 0
        end, last = records.good_end(self.path)
        if end < size:
            self.torn_bytes_dropped = size - end
            os.truncate(self.path, end)
            log.warning("event log %s: dropped a torn last record (%d bytes) left by an unclean stop",
                        self.path, size - end)
        self._size = end
        self.seq = last if last is not None else self._last_archived_seq()
        self._archive_bytes = sum(p.stat().st_size for p in self._archives())

    def _archives(self) -> list[Path]:
        return sorted(self.archive_dir.glob("events-*.jsonl"))

    def _last_archived_seq(self) -> int:
        archives = self._archives()
        if not archives:
            return 0
        try:
            return int(archives[-1].stem.rsplit("-", 1)[1])
        except ValueError:
            return 0

    # -- writer thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._flush_every_s):
            self._drain_guarded()
            with self._drained:
                self._drains += 1
                self._drained.notify_all()
        self._drain_guarded()

    def _drain_guarded(self) -> None:
        try:
            self._drain()
        except Exception:  # the log must never take the node down; say so and keep counting
            log.exception("event log writer failed; events are counted, not written, until it recovers")
            self._enter_counting_only("the writer failed (see the traceback above)")

    def _drain(self) -> None:
        lines: list[bytes] = []
        pending = self._pending
        every = self.limits.check_every
        while pending:
            at, item = pending.popleft()
            self.seq += 1
            if self.seq % every == 0:
                self._write(lines)
                lines = []
                self._check_space()
            if self.counting_only:
                self.counted_only += 1
            else:
                lines.append(records.encode(self.seq, at, item))
        self._write(lines)

    def _write(self, lines: list[bytes]) -> None:
        if not lines:
            return
        if self.counting_only:
            self.counted_only += len(lines)
            return
        data = b"".join(lines)
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            os.ftruncate(self._fd, self._size)  # never leave half a batch behind
            self.counted_only += len(lines)
            if exc.errno == errno.ENOSPC:
                self._enter_counting_only("a write failed: no space left on device (ENOSPC)")
                return
            raise
        self._size += len(data)
        if self._size > self.limits.max_bytes:
            self._compact()

    def _check_space(self) -> None:
        free = self._probe(self.directory)
        floor = self.limits.free_space_floor_bytes
        if free < floor and not self.counting_only:
            gib = free / GiB
            self._enter_counting_only(f"{gib:.2f} GiB free, below the {floor / GiB:.2f} GiB floor")
        elif free >= floor and self.counting_only and self.refused is None:
            self.counting_only, self.counting_reason = False, None
            log.warning("event log %s writes again: %.2f GiB free (%d events were counted, not written)",
                        self.path, free / GiB, self.counted_only)

    def _enter_counting_only(self, reason: str) -> None:
        if self.counting_only:
            return
        self.counting_only, self.counting_reason = True, reason
        log.critical("event log %s is counting-only: %s. Inference goes on; GET /events history thins out on "
                     "this node until disk is freed.", self.path, reason)

    def _compact(self) -> None:
        """Keep the latest keep_events records live; the older part becomes an archive. Crash-safe enough: the
        tail is written to a temporary file first, and `_recover` finishes an interrupted swap."""
        cut = records.start_of_last(self.path, self._size, self.limits.keep_events)
        if cut <= 0:
            return
        first = records.first_seq(self.path) or 0
        tmp = self.path.with_suffix(".tmp")
        with self.path.open("rb") as src:
            src.seek(cut)
            tail = src.read(self._size - cut)
        last_archived = (records.seq_of(tail) or first) - 1
        archive = self.archive_dir / f"events-{first:012d}-{last_archived:012d}.jsonl"
        try:
            tmp.write_bytes(tail)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                self._enter_counting_only("compaction failed: no space left on device (ENOSPC)")
                return
            raise
        with self._lock:
            os.close(self._fd)
            os.rename(self.path, archive)
            os.rename(tmp, self.path)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._size = len(tail)
        os.truncate(archive, cut)
        self.compactions += 1
        self._prune_archives()

    def _prune_archives(self) -> None:
        archives = self._archives()
        sizes = {p: p.stat().st_size for p in archives}
        total = sum(sizes.values())
        while archives and (total > self.limits.archive_max_bytes or len(archives) > self.limits.max_archives):
            oldest = archives.pop(0)
            total -= sizes[oldest]
            oldest.unlink(missing_ok=True)
        self._archive_bytes = total


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def open_for(settings: Settings) -> EventLog | None:
    """The node's event log under <home>/eventlog with skulk.yaml's `event_log` limits, opened; None when off."""
    config = settings.event_log
    if not config.enabled:
        return None
    event_log = EventLog(settings.home / "eventlog", config)
    event_log.open()
    return event_log
