"""Merge the node bundles of a ClusterDiagnostics into one cluster timeline.

Runners sorted by model then rank put the ranks of one instance on adjacent rows, so a rank in a different
phase from its peers stands out; entries sorted by time interleave what every node's runners did.
"""

from __future__ import annotations

from datetime import UTC, datetime

from skulk.diagnostics.clock import iso, parse_iso
from skulk.diagnostics.supervisor_view import timeline_runner
from skulk.diagnostics.warnings import DEFAULT_THRESHOLDS, Thresholds, all_warnings
from skulk.types.diagnostics_bundle import ClusterDiagnostics, ClusterTimeline, TimelineEntry
from skulk.types.state import State

_EPOCH = datetime.min.replace(tzinfo=UTC)


def _entry_key(entry: TimelineEntry) -> tuple[datetime, str, str]:
    return (parse_iso(entry.at) or _EPOCH, entry.node_id, entry.context.runner_id)


def merge_timeline(
    cluster: ClusterDiagnostics,
    now: datetime,
    state: State | None = None,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> ClusterTimeline:
    """Pure. Cluster-wide warnings (rank disagreement first of all) need `state`; without it, none."""
    runners, entries = [], []
    for node in cluster.nodes:
        if not node.ok or node.diagnostics is None:
            continue
        for diag in node.diagnostics.supervisor_runners:
            runners.append(timeline_runner(diag))
            entries.extend(
                TimelineEntry.model_validate({**e.model_dump(), "nodeId": diag.node_id})
                for e in diag.flight_recorder
            )
    runners.sort(key=lambda r: (r.model_id, r.instance_id, r.device_rank, r.node_id))
    entries.sort(key=_entry_key)
    unreachable = [n.node_id for n in cluster.nodes if not n.ok]
    warnings = all_warnings(state, runners, now, thresholds) if state is not None else []
    return ClusterTimeline(
        generated_at=iso(now),
        runners=runners,
        entries=entries,
        unreachable_nodes=unreachable,
        warnings=warnings,
    )
