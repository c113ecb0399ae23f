"""Bundles built from fakes carry every field of seeds 000, 001 and 002 with the seed's JSON types."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from skulk.diagnostics.cluster import collect_cluster
from skulk.diagnostics.node_bundle import build_node_bundle
from skulk.diagnostics.supervisor_view import supervisor_diagnostics, timeline_runner
from skulk.diagnostics.timeline import merge_timeline
from skulk.types.diagnostics_bundle import ClusterDiagnostics, NodeDiagnostics, SkippedDesiredEntry
from skulk.types.ids import NodeId

from . import seed_fields as seeds
from .diagnostics_fakes import NOW, FakeNode, busy_supervisor, cluster_state
from .factories import instance


def _node() -> FakeNode:
    state = cluster_state(("n1", "n2"))
    sup = busy_supervisor(instance("inst", ("n1", "n2")), "n1", "decode_stream", 3.0)
    return FakeNode(NodeId("n1"), state, NodeId("n1"), {sup.spec.runner_id: sup})


def test_supervisor_diagnostics_match_seed_001() -> None:
    sup = busy_supervisor(instance("inst", ("n1", "n2")), "n1", "prefill_barrier", 7.0)
    wire = supervisor_diagnostics(sup, NOW).model_dump(mode="json")
    assert seeds.problems(wire, seeds.RUNNER_SUPERVISOR_DIAGNOSTICS, all_keys=True) == []
    assert wire["secondsInPhase"] == 7.0
    assert wire["activeTaskId"] == "t1"
    assert wire["lastMlxMemory"]["source"] == "psutil"
    assert wire["inProgressTasks"][0]["taskKind"] == "ChatCompletion"
    assert len(wire["flightRecorder"]) == 2


def test_timeline_runner_matches_seed_000() -> None:
    sup = busy_supervisor(instance("inst", ("n1", "n2")), "n2", "decode_barrier", 2.0)
    wire = timeline_runner(supervisor_diagnostics(sup, NOW)).model_dump(mode="json")
    assert seeds.problems(wire, seeds.CLUSTER_TIMELINE_RUNNER, all_keys=True) == []
    assert set(wire) == set(seeds.CLUSTER_TIMELINE_RUNNER)
    assert wire["deviceRank"] == 1 and wire["worldSize"] == 2


def test_node_bundle_matches_seed_002() -> None:
    wire = build_node_bundle(_node(), NOW).model_dump(mode="json")
    assert seeds.problems(wire, seeds.NODE_DIAGNOSTICS, all_keys=True) == []
    assert wire["runtime"]["isMaster"] is True
    assert "libp2PNamespace" in wire["runtime"]
    assert wire["resources"]["system"]["accelerator"]["vendor"] == "cpu"
    assert any(p["role"] == "skulk" and p["isChildOfSkulk"] for p in wire["processes"])
    placement = wire["placements"][0]
    assert placement["masterIsPlacementNode"] and placement["localNodeIsPlacementNode"]
    assert [r["deviceRank"] for r in placement["runners"]] == [0, 1]
    assert placement["runners"][0]["tasks"][0]["taskId"] == "t1"
    assert NodeDiagnostics.model_validate(wire) == NodeDiagnostics.model_validate_json(
        NodeDiagnostics.model_validate(wire).model_dump_json()
    )


def test_node_bundle_reads_the_event_log_and_skipped_desired_entries_from_its_source() -> None:
    """The bundle reads the node's typed event_log and desired_skipped: a counting-only log is a critical warning
    and the skipped entries are listed (neither is probed for, so a renamed attribute fails here)."""
    node = _node()
    assert [w.code for w in build_node_bundle(node, NOW).warning_details if w.code == "event_log_counting_only"] == []
    node.event_log = SimpleNamespace(counting_only=True, counting_reason="ENOSPC", counted_only=7)
    skipped = SkippedDesiredEntry(entry="metaInstances.m1", reason="unknown model")
    node.desired_skipped = lambda: [skipped]
    bundle = build_node_bundle(node, NOW)
    (warning,) = [w for w in bundle.warning_details if w.code == "event_log_counting_only"]
    assert warning.severity == "critical" and "7 events counted" in warning.message
    assert bundle.desired_state_skipped == [skipped]


def test_cluster_bundle_matches_seed_002_with_an_unreachable_peer() -> None:
    node = _node()
    local = build_node_bundle(node, NOW)
    # n2 answers on nothing: 10.0.0.2 is "ours", so it is dialled on loopback at a port nobody listens on.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    state = node.state.model_copy(update={"node_api_ports": {NodeId("n1"): 1, NodeId("n2"): closed}})
    bundle = asyncio.run(collect_cluster(local, state, node.node_id, node.master_id, 0.5, {"10.0.0.2"}))
    wire = bundle.model_dump(mode="json")
    assert seeds.problems(wire, seeds.CLUSTER_DIAGNOSTICS, all_keys=True) == []
    assert [(n["nodeId"], n["ok"]) for n in wire["nodes"]] == [("n1", True), ("n2", False)]
    assert wire["nodes"][1]["error"]
    assert ClusterDiagnostics.model_validate(wire).nodes[0].diagnostics is not None


def test_seed_checker_catches_wrong_types_and_missing_fields() -> None:
    wire = {"generatedAt": 1, "localNodeId": "x", "nodes": [{"nodeId": "a", "ok": "yes"}]}
    found = seeds.problems(wire, seeds.CLUSTER_DIAGNOSTICS)
    assert "$.generatedAt: expected string, got int" in found
    assert "$.nodes[0].ok: expected boolean, got str" in found
    assert seeds.problems({"phase": "nope"}, {"phase": seeds.req("string", enum=seeds.PHASES)})


def test_timeline_response_entries_carry_node_ids() -> None:
    node = _node()
    cluster = ClusterDiagnostics(
        generated_at=NOW.isoformat(),
        local_node_id="n1",
        nodes=[{"nodeId": "n1", "ok": True, "diagnostics": build_node_bundle(node, NOW)}],  # type: ignore[list-item]
    )
    wire = merge_timeline(cluster, NOW, node.state).model_dump(mode="json")
    assert set(wire) >= {"generatedAt", "runners", "entries", "unreachableNodes"}
    assert all(e["nodeId"] == "n1" for e in wire["entries"])
    for e in wire["entries"]:
        assert seeds.problems(e, seeds.FLIGHT_RECORDER_ENTRY, all_keys=True) == []
