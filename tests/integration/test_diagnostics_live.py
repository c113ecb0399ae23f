"""Diagnostics against live node processes: seed schemas in real responses, a wedged rank, a dead peer.

Unit tests check bundles built from fakes; these check that what a real cluster serves matches the same seed
field lists, and that the diagnostics tell the story they exist for: which rank is stuck where.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest

from skulk.diagnostics.cluster import DEFAULT_PEER_TIMEOUT_S
from skulk.testing.nodes import LocalNode

from ..unit import seed_fields as seeds
from .harness import Cluster, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
RECORDER_SIZE = 128
# Rank 1 of the pipeline wedges once it has taken part in admitting a request: its prefill (and first token)
# is done, so rank 0 moves on to wait for the next step at a barrier while rank 1 sits in task_agreement.
WEDGE = "stall:task_agreement:rank=1"
# Keep the waiting rank's group op from timing out (6 s default) while the test looks at the hang.
WEDGE_ENV = {"SKULK_FAULT": WEDGE, "SKULK_GROUP_TIMEOUT_SECONDS": "120"}


def get(node: LocalNode, path: str, timeout: float = 30) -> dict[str, Any]:
    reply = httpx.get(node.url + path, timeout=timeout, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()


def formed(nodes: list[LocalNode]) -> bool:
    """Every node knows every node and all agree on one master."""
    states = [get(n, "/state", 10) for n in nodes]
    ids = {n.node_id for n in nodes}
    links = len(ids) * (len(ids) - 1)
    return all(
        set(s["nodeMemory"]) == ids and len(s["topology"]["connections"]) == links for s in states
    ) and len({s["masterNodeId"] for s in states}) == 1


def chat(node: LocalNode, prompt: str = "hello", tokens: int = 8) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}
    reply = httpx.post(node.url + "/v1/chat/completions", json=body, timeout=60, trust_env=False)
    assert reply.status_code == 200, reply.text


def stream_in_background(node: LocalNode) -> threading.Thread:
    """A streaming request that may never finish (a wedged rank); the thread ends when the node stops."""

    def run() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 64,
            "stream": True,
        }
        try:
            with httpx.stream("POST", node.url + "/v1/chat/completions", json=body, timeout=180) as reply:
                for _ in reply.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    thread = threading.Thread(target=run, name="wedged-stream", daemon=True)
    thread.start()
    return thread


def diag(node: LocalNode) -> str:
    env = {**os.environ, "COLUMNS": "220", "NO_COLOR": "1", "TERM": "dumb"}
    done = subprocess.run(
        [sys.executable, "-m", "skulk", "diag", "--url", node.url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


@pytest.fixture(scope="module")
def placed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[LocalNode], str]]:
    """Three nodes and a Pipeline instance over two of them, shared by the read-only tests of this module."""
    cluster = Cluster(tmp_path_factory.mktemp("diag-live"))
    try:
        nodes = cluster.start(3)
        wait_until(lambda: formed(nodes), 30, "three nodes to form one cluster")
        instance_id = place_and_wait(nodes[0], MODEL, min_nodes=2, sharding="Pipeline")
        yield nodes, instance_id
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


@pytest.mark.timeout(180)
def test_real_responses_carry_every_required_seed_field(placed: tuple[list[LocalNode], str]) -> None:
    nodes, instance_id = placed
    chat(nodes[0])
    for node in nodes:
        bundle = get(node, "/v1/diagnostics/node")
        assert seeds.problems(bundle, seeds.NODE_DIAGNOSTICS) == []
        for runner in bundle.get("supervisorRunners") or []:
            assert seeds.problems(runner, seeds.RUNNER_SUPERVISOR_DIAGNOSTICS) == []
    cluster = get(nodes[0], "/v1/diagnostics/cluster")
    assert seeds.problems(cluster, seeds.CLUSTER_DIAGNOSTICS) == []
    assert {n["nodeId"] for n in cluster["nodes"]} == {n.node_id for n in nodes}
    assert all(n["ok"] for n in cluster["nodes"]), [n.get("error") for n in cluster["nodes"]]
    supervised = [r for n in cluster["nodes"] for r in n["diagnostics"].get("supervisorRunners") or []]
    assert sorted(r["deviceRank"] for r in supervised if r["instanceId"] == instance_id) == [0, 1]
    timeline = get(nodes[1], "/v1/diagnostics/cluster/timeline")
    runners = [r for r in timeline["runners"] if r["instanceId"] == instance_id]
    assert [(r["deviceRank"], r["worldSize"]) for r in runners] == [(0, 2), (1, 2)]
    for runner in timeline["runners"]:
        assert seeds.problems(runner, seeds.CLUSTER_TIMELINE_RUNNER) == []
    assert timeline["entries"] and timeline["unreachableNodes"] == []
    stamps = [datetime.fromisoformat(e["at"]) for e in timeline["entries"]]
    assert stamps == sorted(stamps), "merged entries are sorted by time"
    health = get(nodes[2], "/state")["nodeHealth"]
    assert set(health) == {n.node_id for n in nodes}
    assert all(h["level"] == "healthy" for h in health.values()), health


@pytest.mark.timeout(180)
def test_flight_recorder_keeps_the_newest_128_entries(placed: tuple[list[LocalNode], str]) -> None:
    nodes, instance_id = placed
    for i in range(30):  # each request adds several entries per rank: well over 128 in all
        chat(nodes[2], f"request {i}", tokens=4)
    rank0 = None
    for node in nodes:
        for runner in get(node, "/v1/diagnostics/node").get("supervisorRunners") or []:
            entries = runner["flightRecorder"]
            assert len(entries) <= RECORDER_SIZE
            stamps = [datetime.fromisoformat(e["at"]) for e in entries]
            assert stamps == sorted(stamps), "newest last"
            if runner["instanceId"] == instance_id and runner["deviceRank"] == 0:
                rank0 = entries
    assert rank0 is not None
    assert len(rank0) == RECORDER_SIZE
    events = [e["event"] for e in rank0]
    assert "process_started" not in events and "load_started" not in events, "the oldest were dropped"
    assert any(e["phase"] == "completion" for e in rank0[-6:]), [e["event"] for e in rank0[-6:]]


@pytest.mark.timeout(120)
def test_skulk_diag_renders_the_live_cluster(placed: tuple[list[LocalNode], str]) -> None:
    nodes, _ = placed
    out = diag(nodes[2])
    assert "Skulk cluster timeline" in out, out
    assert "0/2" in out and "1/2" in out, out
    assert MODEL in out, out


@pytest.mark.timeout(240)
def test_wedged_rank_shows_as_rank_disagreement_within_seconds(cluster: Cluster) -> None:
    nodes = cluster.start(2, extra_env=WEDGE_ENV)
    wait_until(lambda: formed(nodes), 30, "two nodes to form one cluster")
    instance_id = place_and_wait(nodes[0], MODEL, min_nodes=2, sharding="Pipeline")
    started = time.monotonic()
    stream_in_background(nodes[0])

    def disagreement() -> dict[str, Any] | None:
        timeline = get(nodes[1], "/v1/diagnostics/cluster/timeline")
        found = [w for w in timeline["warnings"] if w["code"] == "rank_disagreement"]
        return timeline if found else None

    def explain() -> str:
        runners = get(nodes[1], "/v1/diagnostics/cluster/timeline")["runners"]
        return json.dumps([(r["deviceRank"], r["phase"], r["secondsInPhase"]) for r in runners])

    timeline = wait_until(disagreement, 20, "a rank_disagreement warning", explain)
    elapsed = time.monotonic() - started
    assert elapsed < 15, f"the hang took {elapsed:.1f} s to show"
    ranks = {r["deviceRank"]: r for r in timeline["runners"] if r["instanceId"] == instance_id}
    assert ranks[1]["phase"] == "task_agreement", ranks
    # > 4.5, not > 5: the rows and the warnings of one timeline are computed a few ms apart
    assert ranks[0]["phase"] != "task_agreement" and ranks[0]["secondsInPhase"] > 4.5, ranks
    assert all(r["processAlive"] for r in ranks.values()), "a stalled rank stays alive"
    warning = next(w for w in timeline["warnings"] if w["code"] == "rank_disagreement")
    assert warning["instanceId"] == instance_id and warning["runnerId"] == ranks[0]["runnerId"], warning
    assert "STUCK" in diag(nodes[0])


def cluster_view(node: LocalNode) -> tuple[float, dict[str, dict[str, Any]]]:
    started = time.monotonic()
    reply = get(node, "/v1/diagnostics/cluster")
    assert seeds.problems(reply, seeds.CLUSTER_DIAGNOSTICS) == []
    return time.monotonic() - started, {n["nodeId"]: n for n in reply["nodes"]}


@pytest.mark.timeout(180)
def test_dead_peer_is_ok_false_within_the_peer_timeout(cluster: Cluster) -> None:
    """A peer that stopped answering (frozen, as a wedged machine is) is `ok: false` after one per-peer
    timeout while the others are `ok: true`. Once killed, state forgets it at once (NodeTimedOut), but the
    fan-out still lists it as departed: `ok: false` with when it left, at no timeout's cost."""
    nodes = cluster.start(3)
    wait_until(lambda: formed(nodes), 30, "three nodes to form one cluster")
    master = get(nodes[0], "/state")["masterNodeId"]
    asked, alive, victim = sorted(nodes, key=lambda n: n.node_id != master)  # the master stays up
    _, before = cluster_view(asked)
    assert all(n["ok"] for n in before.values()) and len(before) == 3
    assert victim.process is not None
    victim.process.send_signal(signal.SIGSTOP)
    try:
        elapsed, frozen = cluster_view(asked)
    finally:
        victim.kill()
    assert elapsed < DEFAULT_PEER_TIMEOUT_S + 1.5, f"{elapsed:.1f} s with one peer not answering"
    assert frozen[victim.node_id]["ok"] is False and frozen[victim.node_id]["error"], frozen[victim.node_id]
    assert frozen[asked.node_id]["ok"] is True and frozen[alive.node_id]["ok"] is True
    elapsed, after = cluster_view(asked)
    assert elapsed < DEFAULT_PEER_TIMEOUT_S + 1.5, f"{elapsed:.1f} s after the kill"
    assert after[asked.node_id]["ok"] is True and after[alive.node_id]["ok"] is True
    assert after[victim.node_id]["ok"] is False and "left the cluster" in after[victim.node_id]["error"]
