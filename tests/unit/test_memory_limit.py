"""A node knows its memory limit (issue 41): sizes and fractions read, cgroup v1 and v2 trees read as the kernel
lays them out (written here as files), and the budget's decision: the smallest limit binds, usage is counted
against that limit, the reserve is kept back."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulk.config import Settings
from skulk.memory_limit import Amount, CgroupMemory, MemoryWatch, budget, parse_amount, read_cgroup

GB = 1000**3
NO_LIMIT_V1 = 9223372036854771712


@pytest.mark.parametrize(("text", "amount"), [
    ("2.5GB", Amount(bytes=2_500_000_000)), ("2500MiB", Amount(bytes=2500 * 1024**2)),
    ("1073741824", Amount(bytes=1 << 30)),
    ("0.5", Amount(fraction=0.5)), ("50%", Amount(fraction=0.5)), ("8 gib", Amount(bytes=8 << 30)),
])
def test_sizes_and_fractions(text: str, amount: Amount) -> None:
    assert parse_amount(text) == amount


@pytest.mark.parametrize("text", ["lots", "-1GB", "0", "150%", "2.5XB", ""])
def test_bad_amounts_say_what_is_wrong(text: str) -> None:
    with pytest.raises(ValueError):
        parse_amount(text)
    with pytest.raises(ValueError, match="memory_limit"):
        Settings(memory_limit=text)


def _v1(root: Path, group: str, limit: int, usage: int, inactive: int) -> str:
    d = root / "memory" / group
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{NO_LIMIT_V1}\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.stat").write_text(f"cache 5\nrss 7\nhierarchical_memory_limit {limit}\ntotal_inactive_file "
                                   f"{inactive}\n")
    return f"9:name=systemd:/\n4:memory:/{group}\n0::/\n"


def test_cgroup_v1_takes_the_hierarchical_limit(tmp_path: Path) -> None:
    text = _v1(tmp_path, "box/node", 2_500_000_000, 900_000_000, 100_000_000)
    assert read_cgroup(text, tmp_path) == CgroupMemory(1, 2_500_000_000, 900_000_000, 100_000_000)
    unlimited = _v1(tmp_path, "free", NO_LIMIT_V1, 10, 0)
    assert read_cgroup(unlimited, tmp_path) == CgroupMemory(1, None, 10, 0)


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    outer, inner = tmp_path / "slice", tmp_path / "slice" / "node.service"
    inner.mkdir(parents=True)
    (outer / "memory.max").write_text("3000000000\n")
    (inner / "memory.max").write_text("max\n")
    (inner / "memory.current").write_text("1200000000\n")
    (inner / "memory.stat").write_text("anon 1\ninactive_file 200000000\n")
    assert read_cgroup("0::/slice/node.service\n", tmp_path) == CgroupMemory(2, 3_000_000_000, 1_200_000_000,
                                                                             200_000_000)
    assert read_cgroup("0::/slice/node.service\n", tmp_path / "nowhere") is None


def test_inside_a_container_the_group_is_the_mount(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "memory.max").write_text("1600000000\n")
    (tmp_path / "memory.current").write_text("300000000\n")
    assert read_cgroup("0::/\n", tmp_path) == CgroupMemory(2, 1_600_000_000, 300_000_000, 0)


def test_the_smallest_limit_binds_and_usage_counts_against_it() -> None:
    reserve = Amount(bytes=500_000_000)
    machine = budget(25 * GB, 23 * GB, None, None, None, reserve, 0)
    assert (machine.limit, machine.source, machine.used, machine.free) == (25 * GB, "machine", 2 * GB, 22_500_000_000)
    group = CgroupMemory(1, int(2.5 * GB), int(1.2 * GB), int(0.2 * GB))
    capped = budget(25 * GB, 23 * GB, group, None, None, reserve, 0)
    assert (capped.limit, capped.source, capped.used) == (int(2.5 * GB), "cgroup v1", 1 * GB)
    assert capped.free == int(1.5 * GB) - 500_000_000, "the group's room, not the host's 23 GB, less the reserve"
    configured = budget(25 * GB, 23 * GB, group, None, Amount(fraction=0.04), reserve, int(0.3 * GB))
    assert (configured.limit, configured.source, configured.used) == (1 * GB, "--memory-limit", int(0.3 * GB))
    assert configured.free == int(0.7 * GB) - 500_000_000
    mac = budget(64 * GB, 40 * GB, None, 48 * GB, None, Amount(fraction=0.0), 0)
    assert (mac.limit, mac.source, mac.free) == (48 * GB, "gpu working set", 24 * GB)
    tight = budget(25 * GB, 23 * GB, CgroupMemory(2, 1 * GB, 2 * GB, 0), None, None, reserve, 0)
    assert tight.free == 0, "over its limit a node offers nothing, never a negative"


def test_the_watch_reports_a_windowed_fault_rate_and_recent_oom_kills() -> None:
    watch = MemoryWatch(window_s=30, oom_window_s=600)
    assert watch.sample(0.0, 1000, 5) == (None, 0)
    assert watch.sample(10.0, 1500, 5) == (50.0, 0)
    assert watch.sample(40.0, 1500, 6) == (0.0, 1), "faults older than the window drop out; a new OOM kill counts"
    assert watch.sample(700.0, 1500, 6) == (0.0, 0), "an OOM kill 10 minutes ago no longer does"
    assert watch.sample(710.0, 1500, None) == (0.0, None)


def test_the_hog_fault_is_a_crash_of_its_own() -> None:
    from skulk.runner.fault import CrashFault, parse_fault

    assert parse_fault("crash:hog:rank=0") == CrashFault(rank=0, hog=True)
    assert parse_fault("crash:poison") == CrashFault()


def test_a_spare_runner_is_offered_as_free_not_used() -> None:
    """Its process becomes the next runner, whose runtime placement counts already (worker/spare.py)."""
    reserve = Amount(bytes=512 * 1024**2)
    group = CgroupMemory(1, int(1.6 * GB), int(0.9 * GB), 0)
    without = budget(25 * GB, 23 * GB, group, None, None, reserve, 0)
    spare = int(0.25 * GB)
    held = budget(25 * GB, 23 * GB, group, None, None, reserve, 0, standby=spare)
    assert held.free == without.free + spare and held.used == without.used - spare
    assert budget(25 * GB, 23 * GB, None, None, None, reserve, 0, standby=10 * GB).used == 0  # never below nothing
