"""Merging node bundles into the cluster timeline: ordering, node ids, unreachable nodes, warnings."""

from __future__ import annotations

from skulk.diagnostics.node_bundle import build_node_bundle
from skulk.diagnostics.timeline import merge_timeline
from skulk.types.diagnostics_bundle import ClusterDiagnostics, ClusterNodeDiagnostics
from skulk.types.ids import NodeId

from .diagnostics_fakes import NOW, FakeNode, busy_supervisor, cluster_state
from .factories import instance


def _cluster(with_dead_peer: bool = True) -> tuple[ClusterDiagnostics, FakeNode]:
    state = cluster_state(("n1", "n2", "n3"))
    inst = instance("inst", ("n1", "n2", "n3"))
    nodes = []
    # n2 (rank 1) is asked first, so sorting by rank has work to do.
    for name, phase, seconds in (("n2", "decode_barrier", 20.0), ("n1", "decode_stream", 30.0)):
        sup = busy_supervisor(inst, name, phase, seconds)  # type: ignore[arg-type]
        node = FakeNode(NodeId(name), state, NodeId("n1"), {sup.spec.runner_id: sup})
        nodes.append(ClusterNodeDiagnostics(node_id=name, ok=True, diagnostics=build_node_bundle(node, NOW)))
    if with_dead_peer:
        nodes.append(ClusterNodeDiagnostics(node_id="n3", url="http://x", ok=False, error="refused"))
    cluster = ClusterDiagnostics(generated_at=NOW.isoformat(), local_node_id="n2", nodes=nodes)
    return cluster, FakeNode(NodeId("n2"), state, NodeId("n1"))


def test_runners_sorted_by_model_then_rank() -> None:
    cluster, node = _cluster()
    timeline = merge_timeline(cluster, NOW, node.state)
    assert [(r.node_id, r.device_rank) for r in timeline.runners] == [("n1", 0), ("n2", 1)]


def test_entries_merged_across_nodes_and_sorted_by_time() -> None:
    cluster, node = _cluster()
    timeline = merge_timeline(cluster, NOW, node.state)
    ats = [e.at for e in timeline.entries]
    assert len(ats) == 4 and ats == sorted(ats)
    assert {e.node_id for e in timeline.entries} == {"n1", "n2"}
    assert all(e.node_id == e.context.node_id for e in timeline.entries)
    # n1 entered its phase 30 s ago, n2 20 s ago: n1's entries come first.
    assert [e.node_id for e in timeline.entries] == ["n1", "n1", "n2", "n2"]


def test_unreachable_nodes_listed_and_rank_disagreement_warned() -> None:
    cluster, node = _cluster()
    timeline = merge_timeline(cluster, NOW, node.state)
    assert timeline.unreachable_nodes == ["n3"]
    codes = {w.code for w in timeline.warnings}
    assert "rank_disagreement" in codes
    stuck = next(w for w in timeline.warnings if w.code == "rank_disagreement")
    # rank 0 (n1) has streamed nothing for 30 s while rank 1 (n2) waits at decode_barrier: both wait on a peer,
    # and the lowest waiting rank is named (warnings.rank_disagreement)
    assert stuck.runner_id == "r-n1"


def test_without_state_no_warnings_and_all_reachable() -> None:
    cluster, _ = _cluster(with_dead_peer=False)
    timeline = merge_timeline(cluster, NOW)
    assert timeline.warnings == [] and timeline.unreachable_nodes == []
