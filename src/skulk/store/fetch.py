"""One resumable file transfer over HTTP, shared by Hugging Face downloads and staging from the LAN store.

Bytes go to `<dir>/.skulk-partial/<name>.part`; a later call resumes it with a Range request (a server that
ignores Range restarts it from zero); the file takes its final name only once its size matches, so a killed
node or a dropped link leaves a partial that the next attempt continues and a runner never loads.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx

from skulk.store.files import write_marker

PARTIAL_DIR = ".skulk-partial"
POLL_S = 0.25

Progress = Callable[[int, int], None]
"""(bytes on disk so far, files done)."""

Pump = Callable[[int, Callable[[int], None]], None]
"""Writes a response body to an open file descriptor at its position, reporting bytes as they land."""
Opener = Callable[[str, int], AbstractContextManager[tuple[int, Pump]]]
"""(url, first byte) → (HTTP status, body pump): one GET, from `first byte` on when it is not 0."""
CheckResponse = Callable[[httpx.Response], None]
"""Raise a typed error for a response that is not the file (read it first for its body)."""


class SizeMismatch(OSError):
    pass


def partial_path(dest: Path) -> Path:
    return dest.parent / PARTIAL_DIR / (dest.name + ".part")


def partial_bytes(model_dir: Path) -> int:
    folder = model_dir / PARTIAL_DIR
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0


def fetch_file(opener: Opener, url: str, dest: Path, size: int, *, on_bytes: Callable[[int], None]) -> None:
    """dest, size bytes long, from url; resumes a partial left by an earlier attempt."""
    if dest.is_file() and dest.stat().st_size == size:
        return
    part = partial_path(dest)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if have < size:
        _stream(opener, url, part, have, on_bytes)
    got = part.stat().st_size
    if got != size:
        if got > size:
            part.unlink()
        raise SizeMismatch(f"{dest.name}: expected {size} bytes, got {got}")
    os.replace(part, dest)


def _stream(opener: Opener, url: str, part: Path, have: int, on_bytes: Callable[[int], None]) -> None:
    with opener(url, have) as (status, pump):
        resume = bool(have) and status == 206
        if have and not resume:
            on_bytes(-have)
        # A plain descriptor, unbuffered: what arrived is on disk whatever happens next, and a body can be
        # spliced into it (splice refuses O_APPEND, hence the explicit seek).
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | (0 if resume else os.O_TRUNC), 0o644)
        try:
            os.lseek(fd, have if resume else 0, os.SEEK_SET)
            pump(fd, on_bytes)
        finally:
            os.close(fd)


def chunks_pump(chunks: Iterable[bytes]) -> Pump:
    """A pump over body chunks held in Python (httpx's, or any stream without a socket to splice from)."""

    def pump(fd: int, on_bytes: Callable[[int], None]) -> None:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
            on_bytes(len(chunk))

    return pump


def httpx_opener(client: httpx.Client, check: CheckResponse, headers: Mapping[str, str] | None = None) -> Opener:
    """Streams through httpx (redirects, TLS: what Hugging Face needs); check maps error responses."""

    @contextmanager
    def open_stream(url: str, start: int) -> Iterator[tuple[int, Pump]]:
        sent = {**(headers or {}), **({"Range": f"bytes={start}-"} if start else {})}
        with client.stream("GET", url, headers=sent) as response:
            if response.status_code >= 400:
                response.read()
                check(response)
                response.raise_for_status()
            yield response.status_code, chunks_pump(response.iter_bytes())

    return open_stream


class InsufficientDisk(OSError):
    """Refused before the first byte; the message has the arithmetic."""


def check_disk(target: Path, needed: int) -> None:
    probe = target
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise InsufficientDisk(
            f"not enough disk: it needs {needed / 2**30:.2f} GiB ({needed} bytes) and {probe} has "
            f"{free / 2**30:.2f} GiB free; free {(needed - free) / 2**30:.2f} GiB or lower staging_keep_recent_gb"
        )


def fetch_all(
    urls: Mapping[str, str],
    files: Mapping[str, int],
    model_dir: Path,
    *,
    model_id: str,
    on_progress: Progress | None,
    opener: Opener,
    check: Callable[[], None] | None = None,
) -> None:
    """Every file (name → bytes) into model_dir, small ones first, then `check` (which raises on a bad copy),
    then the completion marker. Refused up front when the volume cannot hold what is missing."""
    check_disk(model_dir, sum(files.values()) - present_bytes(model_dir, files))
    model_dir.mkdir(parents=True, exist_ok=True)
    meter = Meter(present_bytes(model_dir, files), on_progress)
    for name in sorted(files, key=lambda n: (n.endswith(".safetensors"), n)):
        fetch_file(opener, urls[name], model_dir / name, files[name], on_bytes=meter.add)
        meter.file_done()
    if check is not None:
        check()
    write_marker(model_dir, model_id, dict(files))
    meter.report(force=True)


def present_bytes(model_dir: Path, files: Mapping[str, int]) -> int:
    """Bytes already on disk: finished files and the partials a retry resumes from."""
    done = sum(size for name, size in files.items() if (model_dir / name).is_file())
    return done + partial_bytes(model_dir)


class Meter:
    """Bytes on disk and files done, reported at most every POLL_S (and once at the end)."""

    def __init__(self, start: int, on_progress: Progress | None, every_s: float = POLL_S) -> None:
        self.bytes = start
        self.files = 0
        self.on_progress = on_progress
        self.every_s = every_s
        self._last = 0.0

    def add(self, n: int) -> None:
        self.bytes += n
        self.report()

    def file_done(self) -> None:
        self.files += 1
        self.report()

    def report(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.on_progress is not None and (force or now - self._last >= self.every_s):
            self._last = now
            self.on_progress(self.bytes, self.files)
