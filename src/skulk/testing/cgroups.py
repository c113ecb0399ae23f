"""Memory-limited control groups for tests and benches: a node run inside one sees a container's limit.

cgroup v1 here (a child of this process's own memory group, so the machine's own limits still hold); a test
that cannot make one skips with `why_not()`'s reason. Every group made is removed on exit (its processes are
moved back to the parent first)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")


def _own_group() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    path = next((line.split(":", 2)[2] for line in lines if line.count(":") >= 2
                 and "memory" in line.split(":", 2)[1].split(",")), None)
    if path is None or not V1_ROOT.is_dir():
        return None
    own = V1_ROOT / path.lstrip("/")
    return own if own.is_dir() else V1_ROOT


def why_not() -> str | None:
    """None when a cgroup v1 memory group can be made here, else why not."""
    if os.geteuid() != 0:
        return "making a memory cgroup needs root"
    own = _own_group()
    if own is None:
        return "no cgroup v1 memory controller is mounted (cgroup v2-only kernels are not covered yet)"
    try:
        probe = own / f"skulk-probe-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot make a memory cgroup under {own}: {exc}"
    return None


class MemoryGroup:
    """A v1 memory group with a hard limit; `add(pid)` moves a process in (its later children follow)."""

    def __init__(self, limit_bytes: int, name: str | None = None) -> None:
        own = _own_group()
        assert own is not None, why_not()
        self.parent = own
        self.path = own / (name or f"skulk-test-{uuid.uuid4().hex[:8]}")
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        self.limit = int((self.path / "memory.limit_in_bytes").read_text())

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.parent / "cgroup.procs").write_text(pid)
                except OSError:
                    continue
            self.path.rmdir()
        except OSError:
            pass

    def __enter__(self) -> MemoryGroup:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
