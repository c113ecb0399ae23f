"""Whether the kernel's out-of-memory killer struck, read without dmesg: a runner that died of SIGKILL is called
out of memory only when an OOM-kill counter went up while it ran; otherwise the kill came from outside (an
operator's `kill -9`, a container runtime), and saying "likely OOM" would send the operator after memory for
nothing.

The counters, most specific first: this process's cgroup v2 `memory.events` (`oom_kill N`: kills in this cgroup
and below), cgroup v1's `memory.oom_control` (`oom_kill N`, kernels 4.13+), then the host's `/proc/vmstat`
(`oom_kill N`: every OOM kill on the machine since boot, so another process's kill in the same window reads as
evidence too; the message says "OOM kill recorded", not more)."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def counter(text: str, name: str = "oom_kill") -> int | None:
    """The `name N` line's N in a kernel key-value file (pure); None when it has none."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def counter_files(cgroup: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """Where this process's OOM-kill counters are, given /proc/self/cgroup's text (pure)."""
    files: list[Path] = []
    for line in cgroup.splitlines():
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if controllers == "":
            files.append(root / rel / "memory.events")
        elif "memory" in controllers.split(","):
            files.append(root / "memory" / rel / "memory.oom_control")
    files.append(Path("/proc/vmstat"))
    return files


def oom_kills() -> int | None:
    """The first readable OOM-kill counter of this process's cgroups or host; None when none can be read."""
    try:
        cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroup = ""
    for path in counter_files(cgroup):
        try:
            found = counter(path.read_text())
        except OSError:
            continue
        if found is not None:
            return found
    return None


def oom_evidence(before: int | None, after: int | None) -> bool | None:
    """True when the counter went up between a runner's start and its exit, False when it did not, None when it
    could not be read."""
    if before is None or after is None:
        return None
    return after > before
