"""The runbook's day-two tools on real nodes: the event log (and its counting-only mode), diagnostics fixes.

One two-node cluster for the module: node0 writes its event log; node1 starts with a free-space floor no disk
can meet, so its log is counting-only from the first check while it goes on serving. A 2-rank instance spans
both. The test that kills a node with kill -9 runs last.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from skulk.testing.convergence import formed, why_not_formed
from skulk.testing.nodes import LocalNode

from .harness import Cluster, place, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
pytestmark = pytest.mark.timeout(240)
NAMESPACE = "day-two-ns"
INGEST = "http://127.0.0.1:9428/insert/jsonline"
DATA_PORTS = range(31200, 31210)  # below Linux's ephemeral ports and outside the default, so nothing else takes them
ENV = {"SKULK_LIBP2P_NAMESPACE": NAMESPACE, "SKULK_LOGGING_ENABLED": "1", "SKULK_LOGGING_INGEST_URL": INGEST,
       "SKULK_DATA_PORTS": f"{DATA_PORTS.start}-{DATA_PORTS.stop - 1}"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalNode, LocalNode]]:
    cluster = Cluster(tmp_path_factory.mktemp("daytwo"), extra_env=ENV)
    try:
        (writer,) = cluster.start(1)
        full_env = {**ENV, "SKULK_EVENT_LOG_FREE_FLOOR_BYTES": str(10**18)}
        (full,) = cluster.start(1, extra_env=full_env)
        nodes = [writer, full]
        wait_until(lambda: formed(nodes), 60, "two nodes to form one cluster", lambda: why_not_formed(nodes))
        place_and_wait(writer, min_nodes=2)
        yield writer, full
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def chat(node: LocalNode, text: str = "ping", max_tokens: int = 6) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    reply = httpx.post(node.url + "/v1/chat/completions", json=body, timeout=60, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()


def events(node: LocalNode, **params: int) -> dict[str, Any]:
    reply = httpx.get(node.url + "/events", params=params, timeout=10, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_events_hold_token_chunks_and_state_events(pair: tuple[LocalNode, LocalNode]) -> None:
    writer, _ = pair
    answer = chat(writer)
    command_id = str(answer["id"]).removeprefix("chatcmpl-")

    def logged() -> list[dict[str, Any]] | None:
        found = events(writer, since=0, limit=10_000)["events"]
        assert isinstance(found, list)
        chunks = [r for r in found if r["kind"] == "TokenChunk" and command_id in str(r["event"])]
        return found if chunks else None

    found = wait_until(logged, 10, "the chat's token chunks in GET /events")
    kinds = {r["kind"] for r in found}
    assert {"TaskCreated", "TokenChunk"} <= kinds, kinds
    seqs = [r["seq"] for r in found]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    page = events(writer, since=seqs[2], limit=3)
    assert [r["seq"] for r in page["events"]] == seqs[3:6] and page["nextSince"] == seqs[5]
    assert page["mode"] == "writing"
    bad = httpx.get(writer.url + "/events", params={"limit": 0}, timeout=10, trust_env=False)
    assert bad.status_code == 422 and "limit" in bad.json()["error"]["message"]
    storage = writer.get("/store/storage")
    assert storage["event_log_bytes"] > 0, storage


def test_counting_only_node_keeps_serving_and_says_so(pair: tuple[LocalNode, LocalNode]) -> None:
    _, full = pair
    chat(full)
    status = events(full, since=0, limit=10)
    assert status["mode"] == "counting_only" and status["events"] == []
    assert "floor" in str(status["countingOnlyReason"])
    critical = [line for line in full.output if "CRITICAL" in line and "counting-only" in line]
    assert len(critical) == 1, full.log_tail()
    bundle = full.get("/v1/diagnostics/node")
    assert any(w["code"] == "event_log_counting_only" for w in bundle["warningDetails"]), bundle["warnings"]
    health = full.get("/state")["nodeHealth"][full.node_id]
    assert health["level"] != "healthy"
    assert any(r["code"] == "event_log_counting_only" for r in health["reasons"]), health
    wait_until(lambda: events(full, since=0, limit=1)["countedNotWritten"], 10, "events counted, not written")


def test_runtime_diagnostics_come_from_settings(pair: tuple[LocalNode, LocalNode]) -> None:
    writer, _ = pair
    runtime = writer.get("/v1/diagnostics/node")["runtime"]
    assert runtime["libp2PNamespace"] == NAMESPACE
    assert runtime["structuredLoggingConfigured"] is True and runtime["loggingIngestUrl"] == INGEST


def test_the_rendezvous_listens_inside_the_data_ports(pair: tuple[LocalNode, LocalNode]) -> None:
    """The 2-rank instance's rendezvous port comes from SKULK_DATA_PORTS, and rank 0's runner listens on it."""
    writer, full = pair
    assert writer.get("/v1/diagnostics/node")["runtime"]["dataPorts"] == "31200-31209"
    instances = writer.get("/state")["instances"]
    ports = [inner["rendezvous"]["port"] for tagged in instances.values() for inner in tagged.values()
             if inner.get("rendezvous")]
    assert len(ports) == 1 and ports[0] in DATA_PORTS, ports

    def listening() -> set[int]:
        found: set[int] = set()
        for pid in writer.runner_pids() | full.runner_pids():
            try:
                found |= {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                          if c.status == psutil.CONN_LISTEN}
            except psutil.NoSuchProcess:
                continue
        return found

    assert ports[0] in listening()


def task_of(node: LocalNode, answer: dict[str, Any]) -> str:
    command_id = str(answer["id"]).removeprefix("chatcmpl-")
    tasks = node.get("/state")["tasks"]
    return next(t["ChatCompletion"]["taskId"] for t in tasks.values() if t["ChatCompletion"]["commandId"] == command_id)


def set_tracing(node: LocalNode, enabled: bool) -> None:
    reply = httpx.put(node.url + "/v1/tracing", json={"enabled": enabled}, timeout=10, trust_env=False)
    assert reply.status_code == 200 and reply.json() == {"enabled": enabled}, reply.text


def test_tracing_two_ranks_only_new_requests(pair: tuple[LocalNode, LocalNode]) -> None:
    writer, full = pair
    assert writer.get("/v1/tracing") == {"enabled": False}
    before = task_of(writer, chat(writer, "untraced", max_tokens=40))
    set_tracing(writer, True)
    wait_until(lambda: full.get("/v1/tracing") == {"enabled": True}, 10, "the flag to reach the other node")
    assert full.get("/v1/diagnostics/node")["runtime"]["tracingEnabled"] is True
    traced = task_of(writer, chat(writer, "traced", max_tokens=40))
    set_tracing(writer, False)

    def both_ranks() -> dict[str, Any] | None:
        body = writer.get(f"/v1/traces/cluster/{traced}")
        ranks = {s["rank"] for s in (body or {}).get("spans", [])}
        return body if {0, 1} <= ranks else None

    body = wait_until(both_ranks, 20, "spans of both ranks in the cluster view")
    names = {s["name"] for s in body["spans"]}
    assert {"tokenize", "prefill", "decode", "api_stream"} <= names, names
    assert set(body["sourceNodes"]) == {writer.node_id, full.node_id}
    listed = writer.get("/v1/traces/cluster")["traces"]
    assert [t["taskId"] for t in listed].count(traced) == 1, "the cluster view de-duplicates by task id"
    entry = next(t for t in listed if t["taskId"] == traced)
    assert entry["modelId"] == MODEL and entry["taskKind"] == "ChatCompletion" and entry["fileSize"] > 0
    assert set(entry["sourceNodes"]) == {writer.node_id, full.node_id}
    assert before not in [t["taskId"] for t in listed], "a request from before the flip is not traced"
    local = {t["taskId"] for t in writer.get("/v1/traces")["traces"]} | {
        t["taskId"] for t in full.get("/v1/traces")["traces"]}
    assert traced in local and before not in local
    stats = writer.get(f"/v1/traces/cluster/{traced}/stats")
    assert stats["taskId"] == traced and stats["totalWallTimeUs"] > 0
    assert {"0", "1"} <= set(stats["byRank"]) and "decode" in stats["byCategory"]
    assert all("pipelineWaitUs" in s["args"] for s in body["spans"] if s["name"] in ("prefill", "decode"))
    raw = writer.get(f"/v1/traces/cluster/{traced}/raw")
    complete = [e for e in raw["traceEvents"] if e["ph"] == "X"]
    assert complete and all(isinstance(e["ts"], int) and e["dur"] >= 0 for e in complete)
    assert httpx.get(writer.url + "/v1/traces/..%2fx", timeout=10, trust_env=False).status_code in (400, 404)
    assert httpx.get(writer.url + "/v1/traces/nope", timeout=10, trust_env=False).status_code == 404
    deleted = httpx.post(full.url + "/v1/traces/delete", json={"taskIds": [traced]}, timeout=10, trust_env=False)
    assert deleted.json() == {"deleted": [traced]}
    assert traced not in {t["taskId"] for t in full.get("/v1/traces")["traces"]}


def restarted(node: LocalNode, old_id: str, pid: int) -> None:
    """The same process (pid) came back with a new node id (ids are per session) and answers again."""
    wait_until(lambda: node.node_id != old_id and node.get("/node_id") == node.node_id, 60,
               "the node to come back after its restart", node.log_tail)
    assert node.process is not None and node.process.pid == pid and node.alive, "same pid: os.execv in place"


def test_admin_restart_in_place_rejoins_and_serves(pair: tuple[LocalNode, LocalNode]) -> None:
    writer, full = pair
    assert full.process is not None
    assert full.get("/v1/diagnostics/node")["supervisorRunners"], "a runner (multiprocessing queues) on it"
    pid, old_id = full.process.pid, full.node_id
    status, body = writer.post(f"/admin/restart?node_id={full.node_id}", {})
    assert (status, body["status"]) == (200, "restart_sent"), body
    restarted(full, old_id, pid)
    status, body = writer.post("/admin/restart?node_id=not-a-node", {})
    assert status == 404 and "not known" in body["error"]["message"]

    old_id = full.node_id
    # Both at once: one after the other, the second may come after the API stopped (0.2 s later, under load)
    with ThreadPoolExecutor(2) as pool:
        first, second = sorted(pool.map(lambda _: full.post("/admin/restart", {}), range(2)), key=lambda r: r[0])
    assert first == (200, {"status": "restarting", "nodeId": old_id})
    assert second[0] == 409 and second[1]["status"] == "restart_already_pending"
    restarted(full, old_id, pid)
    nodes = [writer, full]
    wait_until(lambda: formed(nodes), 60, "the restarted node to rejoin", lambda: why_not_formed(nodes))
    place_and_wait(full)
    assert chat(full)["choices"]


def test_structured_log_lines_are_json_with_ids(pair: tuple[LocalNode, LocalNode]) -> None:
    writer, full = pair
    instance_id = place(writer)["instanceId"]  # placed and deleted at once: the master logs the delete command
    assert httpx.delete(f"{writer.url}/instance/{instance_id}", timeout=10, trust_env=False).status_code == 200

    def records() -> list[dict[str, Any]]:
        master = next(n for n in (writer, full) if n.get("/state")["masterNodeId"] == n.node_id)
        return [json.loads(line) for node in (master, writer, full) for line in node.output if line.startswith("{")]

    def with_command() -> list[dict[str, Any]] | None:
        found = records()
        return found if any("commandId" in r and "deleted on request" in str(r["message"]) for r in found) else None

    found = wait_until(with_command, 10, "a JSON line of the master carrying the command id")
    assert all({"time", "level", "logger", "nodeId", "message"} <= r.keys() for r in found)
    assert {r["nodeId"] for r in found} >= {writer.node_id, full.node_id}
    runner_lines = [r for r in found if "starting runner" in str(r["message"])]
    assert runner_lines and all("instanceId" in r and "runnerId" in r for r in runner_lines)
    human = [line for line in writer.output if " INFO " in line and not line.startswith("{")]
    assert human, "the human-readable lines stay beside the JSON ones"


def test_kill_9_leaves_a_readable_log(pair: tuple[LocalNode, LocalNode], tmp_path: Path) -> None:
    """Last: it kills node0. A torn record is appended after the kill, as a write cut short would leave it."""
    writer, _ = pair
    chat(writer, max_tokens=4)
    before = events(writer, since=0, limit=10_000)["lastSeq"]
    writer.kill()
    live = writer.home / "eventlog" / "events.jsonl"
    with live.open("ab") as f:
        f.write(b'{"seq":999999,"at":1.0,"kind":"TokenChunk","event":{"TokenCh')
    writer.restart().wait_ready()
    after = events(writer, since=0, limit=10_000)
    assert after["tornBytesDroppedAtOpen"] > 0
    assert isinstance(before, int) and after["lastSeq"] >= before
    assert all(isinstance(r["seq"], int) for r in after["events"])
