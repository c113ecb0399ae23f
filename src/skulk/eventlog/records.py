"""The on-disk record format of the event log, and reading it back.

One JSON object per line, `{"seq":N,"v":2,"at":<unix s>,"kind":"<type>","event":{...}}\\n` (`v`: the record's
format version, types/versions.py; a record without it is version 1, the release before versioning), written
whole by one `write` of a batch. A record is complete only with its newline, so a node killed mid-write leaves at
most one torn last line, which `good_end` finds and the log drops on open. Sequence numbers rise (gaps are events
counted but not written in counting-only mode), so a reader finds `since` by bisection on byte offsets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel

from skulk.types.versions import FORMAT_VERSION, RECORD_FIELD, UNVERSIONED

_SEQ_PREFIX = b'{"seq":'
_TAIL_BLOCK = 1 << 16


def encode(seq: int, at: float, item: Any) -> bytes:
    """One record. Called on the writer thread only: serialising is never on the caller's path."""
    inner = getattr(item, "event", None)
    kind = type(inner if isinstance(inner, BaseModel) else item).__name__
    body = item.model_dump_json() if isinstance(item, BaseModel) else json.dumps(item)
    return b'{"seq":%d,"v":%d,"at":%.6f,"kind":"%s","event":%s}\n' % (seq, FORMAT_VERSION, at, kind.encode(),
                                                                      body.encode())


def version_of(record: object) -> int | None:
    """A record's format version (UNVERSIONED without `v`; None when `v` is not a version)."""
    found = record.get(RECORD_FIELD, UNVERSIONED) if isinstance(record, dict) else UNVERSIONED
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def file_version(path: Path) -> int | None:
    """The live file's format, read from its first whole record (FORMAT_VERSION for a file without one: nothing
    to migrate); a line that is not JSON is passed over, so one damaged line does not refuse the whole log."""
    try:
        with path.open("rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and line.endswith(b"\n"):
                    return version_of(record)
    except FileNotFoundError:
        pass
    return FORMAT_VERSION


def migrate_line(line: bytes) -> bytes:
    """A version-1 record in this release's format (pure): `v` after its seq, nothing else changed, so readers
    that find records by their `{"seq":N,` prefix still do. A torn last line is left as it is (dropped on open)."""
    seq = seq_of(line)
    if seq is None or not line.endswith(b"\n"):
        return line
    cut = line.find(b",", len(_SEQ_PREFIX))
    return line[: cut + 1] + b'"%s":%d,' % (RECORD_FIELD.encode(), FORMAT_VERSION) + line[cut + 1 :]


def seq_of(line: bytes) -> int | None:
    """The record's sequence number, read from its fixed prefix without parsing the whole line."""
    if not line.startswith(_SEQ_PREFIX):
        return None
    end = line.find(b",", len(_SEQ_PREFIX))
    try:
        return int(line[len(_SEQ_PREFIX) : end])
    except ValueError:
        return None


def _complete(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return seq_of(line) is not None


def good_end(path: Path) -> tuple[int, int | None]:
    """(bytes that hold complete records, the last complete record's seq). Everything after the last newline,
    and a last line that does not parse, is torn: a write the process did not live to finish."""
    size = path.stat().st_size if path.exists() else 0
    with path.open("rb") if size else open(os.devnull, "rb") as f:
        end = size
        while end > 0:
            start, line = _last_line(f, end)
            if _complete(line):
                return end, seq_of(line)
            end = start
    return 0, None


def _last_line(f: BinaryIO, end: int) -> tuple[int, bytes]:
    """The line that ends at `end` (its newline included when there is one) and where it starts."""
    pos = end
    chunks: list[bytes] = []
    while pos > 0:
        step = min(_TAIL_BLOCK, pos)
        f.seek(pos - step)
        block = f.read(step)
        search_to = len(block) - 1 if pos == end and block.endswith(b"\n") else len(block)
        cut = block.rfind(b"\n", 0, search_to)
        if cut >= 0:
            chunks.append(block[cut + 1 :])
            return pos - step + cut + 1, b"".join(reversed(chunks))
        chunks.append(block)
        pos -= step
    return 0, b"".join(reversed(chunks))


def first_seq(path: Path) -> int | None:
    try:
        with path.open("rb") as f:
            return seq_of(f.readline())
    except FileNotFoundError:
        return None


def start_of_last(path: Path, end: int, count: int) -> int:
    """Byte offset where the last `count` records before `end` begin (0 when there are fewer)."""
    with path.open("rb") as f:
        pos = end
        for _ in range(count):
            if pos <= 0:
                return 0
            pos, _line = _last_line(f, pos)
        return pos


def _line_start_from(f: BinaryIO, pos: int) -> int:
    """The first line start at or after pos."""
    if pos == 0:
        return 0
    f.seek(pos - 1)
    f.readline()
    return f.tell()


def offset_after(f: BinaryIO, size: int, since: int) -> int:
    """Offset of the first record with seq > since, by bisection on byte offsets (seqs rise through the file).
    Invariants: lo is a line start with every record before it at seq <= since; records from hi on are later."""
    lo, hi = 0, size
    while lo < hi:
        probe = _line_start_from(f, (lo + hi) // 2)
        if probe >= hi:
            probe = lo  # no line starts in the upper half: look at the line at lo
        f.seek(probe)
        seq = seq_of(f.readline())
        if seq is not None and seq <= since:
            lo = f.tell()
        else:
            hi = probe
    return lo


def read_after(path: Path, size: int, since: int, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` records with seq > since, oldest first, from the first `size` bytes (whole records)."""
    found: list[dict[str, Any]] = []
    if size <= 0:
        return found
    with path.open("rb") as f:
        f.seek(offset_after(f, size, since))
        while len(found) < limit and f.tell() < size:
            line = f.readline()
            if not line.endswith(b"\n"):
                break
            seq = seq_of(line)
            if seq is not None and seq > since:
                found.append(json.loads(line))
    return found
