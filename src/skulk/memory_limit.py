"""What memory this node may really use: the smallest of the machine's RAM, its control group's limit (cgroup v1
or v2, as a container or a systemd slice sets it), a Mac's GPU working set and the operator's `--memory-limit`,
less a stated reserve. psutil reads the machine, which a container's limit does not change: a node in a 2.5 GB
container would otherwise offer placement the host's 25 GB and be killed or thrash when it gets it.

Used memory is counted against the limit that binds: the group's usage less the file pages it can reclaim
(cgroup), the machine's used memory (machine, working set), or Skulk's own processes (an operator's limit on a
machine shared with other work). Reading is a thin shell (`read_cgroup`, `measure`); the decision is `budget`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import psutil

DEFAULT_RESERVE = "512MiB"
"""Kept back from placement by default: room for the node itself, the OS's growth and a runner's load peak."""
UNLIMITED = 1 << 60
"""At or above this a group limit means none (v1 writes 9223372036854771712 for "no limit")."""
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class Amount:
    """A size in bytes, or a fraction of what it is taken from (the machine's RAM, or the limit)."""

    bytes: int | None = None
    fraction: float | None = None

    def of(self, whole: int) -> int:
        return self.bytes if self.bytes is not None else int((self.fraction or 0.0) * whole)

    def __str__(self) -> str:
        return f"{self.bytes} bytes" if self.bytes is not None else f"{(self.fraction or 0) * 100:g}%"


def parse_amount(text: str) -> Amount:
    """"2.5GB", "2500MiB", "1073741824", "0.5" or "50%" (fractions below 1); ValueError saying what is wrong."""
    raw = text.strip().lower()
    if raw.endswith("%"):
        value = float(raw[:-1])
        if not 0 < value <= 100:
            raise ValueError(f"{text!r}: a percentage must be above 0 and at most 100")
        return Amount(fraction=value / 100)
    match = _SIZE.match(raw)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 8GB, 2500MiB, 0.5 or 50%)")
    number, unit = float(match.group(1)), match.group(2)
    if unit == "" and number < 1:
        if number <= 0:
            raise ValueError(f"{text!r}: a fraction must be above 0")
        return Amount(fraction=number)
    return Amount(bytes=int(number * _UNITS[unit]))


@dataclass(frozen=True)
class CgroupMemory:
    version: int
    limit: int | None
    """The group's effective limit (the tightest of its ancestors'), None when it has none."""
    usage: int
    reclaimable: int
    """Inactive file pages: the kernel drops these before it would kill anything in the group."""

    @property
    def used(self) -> int:
        """What counts against the group's limit: its usage less the page cache it can reclaim."""
        return max(0, self.usage - self.reclaimable)


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("max", "") else int(text)


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split() for line in lines if len(line.split()) == 2)}


def _group_dir(base: Path, group: str) -> Path:
    """The group's directory; inside a container the group is mounted at the root and the path is not there."""
    own = base / group.lstrip("/")
    return own if own.is_dir() else base


def read_cgroup(proc_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> CgroupMemory | None:
    """This process's memory group from /proc/self/cgroup's text: v1's memory controller when mounted, else the
    unified (v2) group; None when neither can be read."""
    entries = [line.split(":", 2) for line in proc_cgroup.splitlines() if line.count(":") >= 2]
    v1 = next((path for _, controllers, path in entries if "memory" in controllers.split(",")), None)
    if v1 is not None and (root / "memory").is_dir():
        group = _group_dir(root / "memory", v1)
        stat = _stat(group / "memory.stat")
        limit = stat.get("hierarchical_memory_limit") or _number(group / "memory.limit_in_bytes")
        usage = _number(group / "memory.usage_in_bytes")
        if usage is None:
            return None
        return CgroupMemory(1, limit if limit and limit < UNLIMITED else None, usage,
                            stat.get("total_inactive_file", stat.get("inactive_file", 0)))
    v2 = next((path for hierarchy, _, path in entries if hierarchy == "0"), None)
    if v2 is None or not (root / "cgroup.controllers").is_file():
        return None
    group = _group_dir(root, v2)
    usage = _number(group / "memory.current")
    if usage is None:
        return None
    limits = [n for d in (group, *group.parents) if d.is_relative_to(root) and (n := _number(d / "memory.max"))]
    limit = min(limits) if limits else None
    return CgroupMemory(2, limit if limit and limit < UNLIMITED else None, usage,
                        _stat(group / "memory.stat").get("inactive_file", 0))


@dataclass(frozen=True)
class Budget:
    """What the node offers: its limit and where it came from, what is used against it, the reserve, and free."""

    limit: int
    source: str
    used: int
    reserved: int
    free: int


def budget(machine_total: int, machine_available: int, cgroup: CgroupMemory | None, working_set: int | None,
           configured: Amount | None, reserve: Amount, own_use: int, standby: int = 0) -> Budget:
    """The binding limit (the smallest) and free memory under it, less the reserve (pure). standby: bytes a spare
    runner holds (worker/spare.py), counted free, not used: the next runner takes that process, and placement
    counts that runner's runtime already (1.05 x its share + 576 MiB), so counting the spare too would count the
    same memory twice."""
    candidates = [(machine_total, "machine")]
    if cgroup is not None and cgroup.limit is not None:
        candidates.append((cgroup.limit, f"cgroup v{cgroup.version}"))
    if working_set is not None:
        candidates.append((working_set, "gpu working set"))
    if configured is not None:
        candidates.append((configured.of(machine_total), "--memory-limit"))
    limit, source = min(candidates, key=lambda c: c[0])
    machine_used = machine_total - machine_available
    group_used = cgroup.used if cgroup is not None else 0
    used = {"--memory-limit": own_use, "machine": machine_used, "gpu working set": machine_used}.get(source,
                                                                                                    group_used)
    room = [limit - used, machine_available]
    if cgroup is not None and cgroup.limit is not None:
        room.append(cgroup.limit - group_used)
    reserved = min(reserve.of(limit), limit)
    standby = max(0, min(standby, used))
    return Budget(limit, source, used - standby, reserved, max(0, min(room) - reserved) + standby)


def own_use() -> int:
    """Resident bytes of this process and its children (the node and its runners)."""
    me = psutil.Process()
    total = 0
    for process in (me, *me.children(recursive=True)):
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


def this_cgroup() -> CgroupMemory | None:
    try:
        return read_cgroup(Path("/proc/self/cgroup").read_text())
    except (OSError, ValueError):
        return None


def available_now() -> int:
    """Free memory for this process now, its group's limit counted (what a runner sizes a default KV pool by)."""
    free = psutil.virtual_memory().available
    group = this_cgroup()
    if group is not None and group.limit is not None:
        free = min(free, max(0, group.limit - group.used))
    return free


def major_faults(pids: list[int]) -> int:
    """Major page faults of these processes so far: pages read back from disk (Linux; 0 where unreadable)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[9])
        except (OSError, IndexError, ValueError):
            continue
    return total


def family() -> list[int]:
    """This process and its children (the node and its runners)."""
    me = psutil.Process()
    try:
        return [me.pid, *(c.pid for c in me.children(recursive=True))]
    except psutil.Error:
        return [me.pid]


@dataclass
class MemoryWatch:
    """Signs of memory trouble on this node, sampled with its facts: major faults a second of the node and its
    runners over the last `window_s` (weights read back from disk, over and over, when they do not fit), and OOM
    kills counted since the first sample (in its group, or on the machine: worker/oom.py reads the counters)."""

    window_s: float = 30.0
    oom_window_s: float = 600.0
    _faults: list[tuple[float, int]] = field(default_factory=list)
    _ooms: list[tuple[float, int]] = field(default_factory=list)

    def sample(self, now: float, faults: int, oom: int | None) -> tuple[float | None, int | None]:
        """(major faults a second over the last window_s, OOM kills over the last oom_window_s); None where
        unknown. Trouble that stopped leaves the figures, and the node's health clears."""
        then, first = _windowed(self._faults, now, faults, self.window_s)
        rate = round((faults - first) / (now - then), 1) if now > then else None
        if oom is None:
            return rate, None
        return rate, oom - _windowed(self._ooms, now, oom, self.oom_window_s)[1]


def _windowed(samples: list[tuple[float, int]], now: float, value: int, window_s: float) -> tuple[float, int]:
    """Append (now, value) and return the oldest sample still within the window (the first, if none is older)."""
    samples.append((now, value))
    while len(samples) > 2 and samples[1][0] <= now - window_s:
        samples.pop(0)
    return samples[0]
