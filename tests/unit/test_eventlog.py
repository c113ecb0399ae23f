"""The event log with small thresholds: the same code path as the runbook's 256 MiB / 20k / 1 GiB / 2 GiB."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skulk.eventlog import EventLog, Limits
from skulk.eventlog import log as eventlog_module
from skulk.types.chunks import TokenChunk
from skulk.types.ids import CommandId

pytestmark = pytest.mark.timeout(60)

ROOM = 1 << 50


def chunk(i: int) -> TokenChunk:
    return TokenChunk(command_id=CommandId("c1"), text=f"tok{i}", token_id=i, completion_tokens=i)


@pytest.fixture
def free() -> list[int]:
    return [ROOM]


def open_log(path: Path, free: list[int], **limits: int) -> EventLog:
    log = EventLog(path, Limits(**limits), probe=lambda _p: free[0], flush_every_s=0.005)
    log.open()
    return log


@pytest.fixture
def elog(tmp_path: Path, free: list[int]) -> Iterator[EventLog]:
    log = open_log(tmp_path, free)
    yield log
    log.close()


def test_append_read_since_limit_and_reopen(tmp_path: Path, free: list[int]) -> None:
    log = open_log(tmp_path, free)
    for i in range(100):
        log.append(chunk(i))
    assert log.flush()
    got = log.read(since=0, limit=10)
    assert [r["seq"] for r in got] == list(range(1, 11))
    assert got[0]["kind"] == "TokenChunk" and got[0]["event"]["TokenChunk"]["text"] == "tok0"
    assert [r["seq"] for r in log.read(since=95, limit=100)] == [96, 97, 98, 99, 100]
    assert log.read(since=100, limit=10) == []
    log.close()
    again = open_log(tmp_path, free)
    again.append(chunk(100))
    assert again.flush()
    assert [r["seq"] for r in again.read(since=99, limit=10)] == [100, 101], "numbering goes on after a restart"
    again.close()


def test_compaction_keeps_latest_and_caps_archives(tmp_path: Path, free: list[int]) -> None:
    log = open_log(tmp_path, free, max_bytes=20_000, keep_events=50, archive_max_bytes=60_000, max_archives=100)
    for round_ in range(40):
        for i in range(50):
            log.append(chunk(round_ * 50 + i))
        assert log.flush()
    assert log.compactions >= 5
    live = log.read(since=0, limit=10_000)
    assert live[-1]["seq"] == 2000
    assert log.path.stat().st_size <= 20_000 + 50 * 200, "the live file is ring-compacted"
    assert [r["seq"] for r in live] == list(range(live[0]["seq"], 2001)), "the latest events, in order"
    archives = sorted((tmp_path / "archive").iterdir())
    assert archives and sum(p.stat().st_size for p in archives) <= 60_000, "archives are capped by bytes"
    assert log.status()["bytes"] == log.path.stat().st_size + sum(p.stat().st_size for p in archives)
    first_archived = int(archives[0].name.split("-")[1])
    assert first_archived > 1, "the oldest archives were dropped"
    log.close()


def test_archive_count_cap(tmp_path: Path, free: list[int]) -> None:
    log = open_log(tmp_path, free, max_bytes=5_000, keep_events=5, max_archives=3)
    for i in range(1500):
        log.append(chunk(i))
        if i % 100 == 99:
            assert log.flush()
    assert log.flush()
    assert len(list((tmp_path / "archive").iterdir())) <= 3
    log.close()


def test_free_space_floor_counts_then_recovers(
    tmp_path: Path, free: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    log = open_log(tmp_path, free, check_every=16, free_space_floor_bytes=1000)
    for i in range(10):
        log.append(chunk(i))
    assert log.flush()
    free[0] = 999
    with caplog.at_level(logging.WARNING, logger="skulk.eventlog"):
        for i in range(200):
            log.append(chunk(i))
        assert log.flush()
    assert log.counting_only and log.status()["mode"] == "counting_only"
    assert log.counted_only == 200 - 5, "written up to the check at seq 16, counted from it on"
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1 and "counting-only" in critical[0].getMessage()
    written = log.read(since=0, limit=1000)
    assert written[-1]["seq"] == 15
    free[0] = ROOM
    for i in range(40):
        log.append(chunk(i))
    assert log.flush()
    assert not log.counting_only, "writing again once a check finds room"
    assert log.read(since=15, limit=1000)[0]["seq"] == 224, "a gap: the counted events were not written"
    log.close()


def test_enospc_degrades_without_tearing(tmp_path: Path, free: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    log = open_log(tmp_path, free, check_every=8)
    for i in range(5):
        log.append(chunk(i))
    assert log.flush()

    def full(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])  # half a batch lands, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eventlog_module, "_write_all", full)
    for i in range(5):
        log.append(chunk(i))
    assert log.flush()
    assert log.counting_only and "ENOSPC" in (log.counting_reason or "")
    assert log.path.read_bytes().endswith(b"\n"), "the half-written batch was cut back"
    assert [r["seq"] for r in log.read(since=0, limit=100)] == [1, 2, 3, 4, 5]
    monkeypatch.undo()
    for i in range(20):
        log.append(chunk(i))
    assert log.flush()
    assert not log.counting_only, "space is back (the probe says so at the next check)"
    log.close()


def test_torn_last_record_is_dropped(tmp_path: Path, free: list[int]) -> None:
    log = open_log(tmp_path, free)
    for i in range(10):
        log.append(chunk(i))
    assert log.flush()
    log.close()
    with (tmp_path / "events.jsonl").open("ab") as f:
        f.write(b'{"seq":11,"at":1.0,"kind":"TokenChunk","event":{"text":"to')
    again = open_log(tmp_path, free)
    assert again.torn_bytes_dropped > 0
    again.append(chunk(11))
    assert again.flush()
    assert [r["seq"] for r in again.read(since=0, limit=100)] == list(range(1, 12))
    again.close()


WRITER = """
import sys, time
from pathlib import Path
from skulk.eventlog import EventLog, Limits
from skulk.types.chunks import TokenChunk
log = EventLog(Path(sys.argv[1]), Limits(free_space_floor_bytes=0), flush_every_s=0.0005)
log.open()
i = 0
while True:
    for _ in range(200):
        i += 1
        log.append(TokenChunk(command_id="c", text="x" * (i % 300), token_id=i))
    time.sleep(0.0005)
"""


def test_kill_9_mid_write_leaves_a_readable_log(tmp_path: Path, free: list[int]) -> None:
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        live = tmp_path / "events.jsonl"
        deadline = time.monotonic() + 30
        while not (live.exists() and live.stat().st_size > 2_000_000) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    log = open_log(tmp_path, free)
    size = log.path.stat().st_size
    lines = log.path.read_bytes().splitlines()
    assert all(json.loads(line)["seq"] for line in lines), "every record left after recovery parses"
    assert [json.loads(line)["seq"] for line in lines] == list(range(1, len(lines) + 1))
    log.append(chunk(0))
    assert log.flush()
    assert log.read(since=len(lines), limit=10)[0]["seq"] == len(lines) + 1
    assert size > 2_000_000
    log.close()


def test_since_is_found_by_bisection_across_gaps(tmp_path: Path) -> None:
    """Counting-only mode leaves gaps in the numbering; every `since` still lands on the next record."""
    import random

    from skulk.eventlog import records

    rng = random.Random(4)
    seqs = sorted(rng.sample(range(1, 5000), 700))
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(records.encode(s, 0.0, {"pad": "x" * rng.randint(0, 300)}) for s in seqs))
    size = path.stat().st_size
    for since in [0, *rng.sample(range(0, 5001), 300), seqs[-1], 10**9]:
        expected = [s for s in seqs if s > since][:5]
        assert [r["seq"] for r in records.read_after(path, size, since, 5)] == expected, since
