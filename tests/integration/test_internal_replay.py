"""Nothing a listener captures between nodes can be reused (issue 38). Two real nodes with a cluster key and an
admin key talk as they always do (topology and link probes, diagnostics and trace fan-out, a staging purge);
a keyless listener on loopback reads every node-to-node HTTP call off the wire, then replays each one as it saw
it, re-aims it at the other node, and grafts its signature onto the admin routes it wants. Nothing gets a 2xx.
The nodes' own signed probes still work: both see each other's links, measured."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from skulk.cluster.seal import generate_key
from skulk.internal_auth import HEADER

from .harness import Cluster, wait_until
from .wire_capture import Captured, LoopbackCapture, can_capture

pytestmark = pytest.mark.timeout(180)
ADMIN = "an-admin-key-of-the-test"
WANTED = ("/node/probe", "/node/link_probe", "/v1/diagnostics/node", "/v1/traces", "/store/purge-staging/local")
GRAFTS = [("POST", "/place_instance"), ("DELETE", "/instance/abc"), ("PUT", "/v1/tracing"), ("GET", "/config"),
          ("GET", "/state"), ("GET", "/v1/diagnostics/node"), ("POST", "/store/purge-staging")]


def _send(port: int, seen: Captured, method: str | None = None, target: str | None = None) -> httpx.Response:
    headers = [(k, v) for k, v in seen.headers if k.lower() not in ("content-length", "connection")]
    return httpx.request(method or seen.method, f"http://127.0.0.1:{port}{target or seen.target}", headers=headers,
                         content=seen.body, timeout=10, trust_env=False)


def _internal(capture: LoopbackCapture) -> Callable[[], list[Captured]]:
    return lambda: [r for r in capture.requests() if r.header(HEADER) is not None]


def test_a_listener_cannot_reuse_what_nodes_send_each_other(cluster: Cluster, tmp_path: Path) -> None:
    if (why := can_capture()) is not None:
        pytest.skip(why)
    for index in range(2):
        home = cluster.root / f"node{index}"
        home.mkdir(parents=True, exist_ok=True)
        (home / "skulk.yaml").write_text("link_bandwidth_seconds: 1\n")
    env = {"SKULK_CLUSTER_KEY": generate_key(), "SKULK_ADMIN_KEYS": ADMIN}
    nodes = cluster.form(2, extra_env=env, headers={"Authorization": f"Bearer {ADMIN}"})
    ports = {n.api_port for n in nodes}
    with LoopbackCapture(frozenset(ports)) as capture:
        seen = _internal(capture)
        wait_until(lambda: {r.target.split("?")[0] for r in seen()} >= set(WANTED[:2]), 30,
                   "signed topology and link probes on the wire", lambda: str(sorted({r.target for r in seen()})))
        for node in nodes:
            assert node.get("/v1/diagnostics/cluster", timeout=30) is not None
            assert node.get("/v1/traces/cluster", timeout=30) is not None
            assert node.post("/store/purge-staging", {})[0] == 200
        paths = lambda: {r.target.split("?")[0].rstrip("/") for r in seen()}  # noqa: E731
        wait_until(lambda: paths() >= set(WANTED), 30, "every kind of node-to-node call captured",
                   lambda: str(sorted(paths())))
    captured = seen()

    def links() -> dict:
        return (nodes[0].get("/state") or {}).get("nodeLinks", {})

    def both_measured() -> bool:
        """Each node's signed probes of its peer reached the state: a probe seen on the wire lands in /state a
        moment later (the master orders the measurement), so the test waits for the state, not the wire."""
        table = links()
        for node in nodes:
            peer = next(p for p in nodes if p is not node)
            measured = table.get(node.node_id, {}).get(peer.node_id) or {}
            if measured.get("rttMs") is None or not measured.get("bandwidthMbps"):
                return False
        return True

    wait_until(both_measured, 30, "signed probes measured both links", lambda: f"signed probes: {links()}")

    other = {a: b for a, b in zip(sorted(ports), sorted(ports, reverse=True), strict=True)}
    first = captured[0]
    aimed = _send(other[first.port], first)
    assert aimed.status_code == 401 and "another node" in aimed.json()["error"]["message"], aimed.text
    for method, target in GRAFTS:
        grafted = _send(first.port, first, method, target)
        assert grafted.status_code == 401, (method, target, grafted.status_code, grafted.text[:200])
    for call in captured:
        replayed = _send(call.port, call)
        assert replayed.status_code == 401, (call.method, call.target, replayed.status_code, replayed.text[:200])
        assert replayed.json()["error"]["code"] == "invalid_internal_token"
