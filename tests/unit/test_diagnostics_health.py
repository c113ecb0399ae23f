"""nodeHealth levels: healthy, disk low (degraded), disk full and unreachable (unhealthy)."""

from __future__ import annotations

from datetime import timedelta

from skulk.diagnostics.health import cluster_health, node_health
from skulk.types.ids import NodeId
from skulk.types.memory import Memory
from skulk.types.node_info import DiskUsage, MemoryUsage
from skulk.types.state import State

from .diagnostics_fakes import NOW, cluster_state

N1 = NodeId("n1")


def _with_free_disk(gb: float) -> State:
    state = cluster_state()
    disk = DiskUsage(total=Memory.from_gb(500), available=Memory.from_gb(gb))
    return state.model_copy(update={"node_disk": {**state.node_disk, N1: disk}})


def test_healthy_node() -> None:
    health = node_health(cluster_state(), N1, NOW)
    assert health.level == "healthy" and health.reasons == []


def test_disk_low_is_degraded() -> None:
    health = node_health(_with_free_disk(9.5), N1, NOW)
    assert health.level == "degraded"
    assert [r.code for r in health.reasons] == ["disk_low"]
    assert health.reasons[0].remediation


def test_disk_full_at_two_gib_is_unhealthy() -> None:
    health = node_health(_with_free_disk(2.0), N1, NOW)
    assert health.level == "unhealthy" and [r.code for r in health.reasons] == ["disk_full"]
    assert node_health(_with_free_disk(10.0), N1, NOW).level == "healthy"


def test_unreachable_when_not_seen_recently() -> None:
    late = NOW + timedelta(seconds=31)
    health = node_health(cluster_state(), N1, late)
    assert health.level == "unhealthy" and health.reasons[0].code == "unreachable"
    assert node_health(cluster_state(), NodeId("never"), NOW).reasons[0].code == "unreachable"
    assert node_health(cluster_state(), N1, NOW + timedelta(seconds=29)).level == "healthy"


def test_cluster_health_covers_every_node_and_serialises_camel_case() -> None:
    health = cluster_health(_with_free_disk(1.0), NOW)
    assert set(health) == {"n1", "n2"}
    wire = health[N1].model_dump(mode="json")
    assert wire["level"] == "unhealthy"
    assert set(wire["reasons"][0]) == {"code", "message", "remediation"}


def _with_memory(**trouble: object) -> State:
    state = cluster_state()
    memory = MemoryUsage(ram_total=Memory.from_bytes(2_500_000_000), ram_available=Memory.from_bytes(10**8),
                         limit_source="cgroup v2", **trouble)  # type: ignore[arg-type]
    return state.model_copy(update={"node_memory": {**state.node_memory, N1: memory}})


def test_an_oom_kill_is_unhealthy_and_names_the_limit() -> None:
    health = node_health(_with_memory(oom_kills=2), N1, NOW)
    assert health.level == "unhealthy" and [r.code for r in health.reasons] == ["memory_oom"]
    assert "2.50 GB limit (cgroup v2)" in health.reasons[0].message and health.reasons[0].remediation


def test_paging_is_degraded_below_the_threshold_nothing() -> None:
    assert [r.code for r in node_health(_with_memory(major_faults_per_s=46.0), N1, NOW).reasons] == ["memory_paging"]
    assert node_health(_with_memory(major_faults_per_s=3.0), N1, NOW).level == "healthy"
    assert node_health(_with_memory(oom_kills=0, major_faults_per_s=None), N1, NOW).level == "healthy"
