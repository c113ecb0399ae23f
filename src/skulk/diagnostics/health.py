"""Per-node health for `/state`'s `nodeHealth`: a level and the reasons behind it, each with a remediation.

Pure function of the event-sourced state and `now`, so every node computes the same answer from the same
state. Download failures are not event-sourced yet; the `download_failed` code is reserved for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from skulk.types.diagnostics_bundle import HealthLevel, HealthReason, NodeHealth
from skulk.types.ids import NodeId
from skulk.types.memory import GB
from skulk.types.state import State

DISK_FULL_BYTES = 2 * GB
DISK_LOW_BYTES = 10 * GB
UNREACHABLE_AFTER = timedelta(seconds=30)

_SEVERE = {"disk_full", "unreachable", "download_failed", "memory_oom"}


def _disk_reason(state: State, node_id: NodeId) -> HealthReason | None:
    disk = state.node_disk.get(node_id)
    if disk is None:
        return None
    free_gb = disk.available.in_gb
    if disk.available.in_bytes <= DISK_FULL_BYTES:
        return HealthReason(
            code="disk_full",
            message=f"only {free_gb:.1f} GiB free on the Skulk home disk (≤ 2 GiB)",
            remediation=(
                "free disk space, or evict not-in-use staged models on every node with "
                "POST /store/purge-staging and the JSON body {} (or {\"modelId\": …} for one model)"
            ),
        )
    if disk.available.in_bytes < DISK_LOW_BYTES:
        return HealthReason(
            code="disk_low",
            message=f"{free_gb:.1f} GiB free on the Skulk home disk (< 10 GiB)",
            remediation="free disk space before placing another model; staged copies need room",
        )
    return None


def _reach_reason(state: State, node_id: NodeId, now: datetime, after: timedelta) -> HealthReason | None:
    seen = state.last_seen.get(node_id)
    if seen is not None and now - seen <= after:
        return None
    ago = "never reported" if seen is None else f"last reported {(now - seen).total_seconds():.0f} s ago"
    return HealthReason(
        code="unreachable",
        message=f"node {node_id[:8]} {ago}",
        remediation="check that the node's skulk process is running and that the network between nodes is up",
    )


def event_log_reason(counting_reason: str) -> HealthReason:
    """This node's event log only counts (runbook 004): inference goes on, /events history thins out."""
    return HealthReason(
        code="event_log_counting_only",
        message=f"the event log is counting-only: {counting_reason}",
        remediation="free disk on this node (GET /store/storage shows what uses it); the log writes again by itself",
    )


def node_health(
    state: State,
    node_id: NodeId,
    now: datetime,
    unreachable_after: timedelta = UNREACHABLE_AFTER,
    local: Sequence[HealthReason] = (),
) -> NodeHealth:
    """`local`: reasons only the node itself knows (its event log's mode), added to the state-derived ones."""
    reasons = [
        r
        for r in (_reach_reason(state, node_id, now, unreachable_after), _disk_reason(state, node_id))
        if r is not None
    ] + memory_reasons(state, node_id) + list(local)
    level: HealthLevel = "healthy"
    if reasons:
        level = "unhealthy" if any(r.code in _SEVERE for r in reasons) else "degraded"
    return NodeHealth(level=level, reasons=reasons)


def cluster_health(
    state: State, now: datetime, local: Mapping[NodeId, Sequence[HealthReason]] | None = None
) -> dict[NodeId, NodeHealth]:
    """One entry per node the state knows of; ready to publish as `/state`'s `nodeHealth`. `local` holds the
    answering node's own, not event-sourced, reasons (each node reports its own event log)."""
    local = local or {}
    nodes = {*state.last_seen, *state.topology.nodes, *state.node_disk}
    return {node: node_health(state, node, now, local=local.get(node, ())) for node in sorted(nodes)}


_BUSY_LOADING = {"RunnerConnecting", "RunnerConnected", "RunnerLoading", "RunnerLoaded", "RunnerWarmingUp"}
_MEMORY_REMEDY = ("place the model over more nodes (min_nodes), with a smaller quantization or a smaller kv_cache_gb, "
                  "or raise this node's limit (its container's or cgroup's memory, or --memory-limit)")


def _loading(state: State, node_id: NodeId) -> bool:
    """Whether a runner of this node is loading: its first read of the weights faults every page in once."""
    runners = [i.shard_assignments.node_to_runner.get(node_id) for i in state.instances.values()]
    return any(type(state.runners.get(r)).__name__ in _BUSY_LOADING for r in runners if r is not None)


def memory_reasons(state: State, node_id: NodeId) -> list[HealthReason]:
    """The kernel killed for memory here lately (memory_oom), or the served weights are being read back from
    disk (memory_paging); each names the node's limit and where it came from."""
    memory = state.node_memory.get(node_id)
    if memory is None:
        return []
    limit = f"{memory.ram_total.in_bytes / 1e9:.2f} GB limit ({memory.limit_source or 'machine'})"
    reasons = []
    if memory.oom_kills:
        reasons.append(HealthReason(code="memory_oom", remediation=_MEMORY_REMEDY,
                                    message=f"the kernel's OOM killer ended {memory.oom_kills} process(es) under "
                                    f"this node's {limit} in the last 10 minutes"))
    if memory.paging and not _loading(state, node_id):
        reasons.append(HealthReason(code="memory_paging", remediation=_MEMORY_REMEDY,
                                    message=f"reading {memory.major_faults_per_s:g} pages a second back from disk: "
                                    f"the served weights do not fit this node's {limit}"))
    return reasons
