"""The model store's file server serves only its cluster (issue 27): with a cluster key set, a worker stages its
shard from the store host (its requests carry the internal token), while a request without the token, or with a
wrong one, gets a typed 401 for the registry, a model's file list and a weight file alike; and the worker's own
signed reads, captured off the wire and replayed (issue 38), get 401 too."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest

from skulk.cluster.seal import generate_key
from skulk.testing.nodes import free_port
from tests.fake_hub import write_random_model

from .harness import Cluster, instance_ready, place, wait_until
from .wire_capture import LoopbackCapture, can_capture

pytestmark = pytest.mark.timeout(240)
MODEL = "org/tiny-store"


def _yaml(home: Path, store_path: Path, port: int) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "skulk.yaml").write_text(
        "model_store:\n  enabled: true\n  store_host: store\n  store_address: 127.0.0.1\n"
        f"  store_port: {port}\n  store_path: {store_path}\n  download: {{allow_hf_fallback: false}}\n")


def test_the_store_serves_only_its_cluster(cluster: Cluster, tmp_path: Path) -> None:
    store_path = tmp_path / "store"
    write_random_model(store_path, MODEL, shards=2, layers=4)
    port = free_port()
    _yaml(cluster.root / "node0", store_path, port)
    _yaml(cluster.root / "node1", tmp_path / "worker-store", port)
    env = {"SKULK_CLUSTER_KEY": generate_key(), "HF_ENDPOINT": "http://127.0.0.1:9"}
    host = cluster.start(1, extra_env={"SKULK_NODE_NAME": "store", **env})[0]
    worker = cluster.start(1, extra_env={"SKULK_NODE_NAME": "worker", **env})[0]
    wait_until(lambda: len((host.get("/state") or {}).get("nodeMemory", {})) == 2, 30, "two nodes' memory")
    status, added = host.post("/models/add", {"model_id": MODEL})
    assert status == 200, added

    base = f"http://127.0.0.1:{port}"
    for path in ("/registry", f"/models/{MODEL}/files", f"/models/{MODEL}/files/config.json",
                 f"/models/{MODEL}/files/model-00001-of-00002.safetensors"):
        for headers, code in (({}, "missing_internal_token"), ({"x-skulk-internal": "0" * 64},
                                                                 "invalid_internal_token")):
            reply = httpx.get(base + path, headers=headers, timeout=10)
            assert reply.status_code == 401, (path, reply.status_code, reply.text[:200])
            assert reply.json()["error"]["code"] == code
    assert httpx.post(base + "/registry", timeout=10).status_code == 401, "no 405 that confirms the route first"
    assert host.get("/store/registry")["entries"][0]["model_id"] == MODEL, "the node's own API reaches it"
    assert worker.get("/store/health")["store_reachable"] is True

    with contextlib.ExitStack() as stack:
        capture = stack.enter_context(LoopbackCapture(frozenset({port}))) if can_capture() is None else None
        instance_id = place(host, MODEL, min_nodes=2)["instanceId"]
        wait_until(lambda: instance_ready(host, instance_id), 120, "the instance to be ready", worker.log_tail)
    progress = (host.get("/state") or {})["downloads"][worker.node_id][MODEL]
    assert (progress["status"], progress["source"]) == ("Completed", "store")
    if capture is not None:  # the worker's signed reads, taken off the wire, replayed by a keyless listener
        reads = [r for r in capture.requests() if r.header("x-skulk-internal")]
        assert any("safetensors" in r.target for r in reads), [r.target for r in reads]
        for read in reads:
            headers = {k: v for k, v in read.headers if k.lower() in ("x-skulk-internal", "range")}
            reply = httpx.get(base + read.target, headers=headers, timeout=10)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_internal_token", read
