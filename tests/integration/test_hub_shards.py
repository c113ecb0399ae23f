"""A node fetches only its share from the hub: three real nodes without a store, each pointed at the local hub
stand-in under its own endpoint, a checkpoint in three shard files, a three-rank Pipeline placement. Each node
downloads the index, the small files and only the weight files holding its layers (into its staging root; its
store_path stays empty), /state reports the bytes of that share, the hub's log shows each weight file fetched by
exactly the nodes whose layers it holds, and the split instance answers a chat."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from skulk.store.files import files_for_shard, is_needed
from skulk.testing.nodes import LocalNode
from tests.fake_hub import RunningHub, write_random_model

from .harness import Cluster, instance_ready, place, wait_until

pytestmark = pytest.mark.timeout(240)

MODEL = "org/tiny-hub-shards"
FILES = 3
LAYERS = 6


def _my_shard(state: dict[str, Any], instance_id: str, node_id: str) -> dict[str, Any]:
    inner = next(iter(state["instances"][instance_id].values()))
    runner = inner["shardAssignments"]["nodeToRunner"][node_id]
    return next(iter(inner["shardAssignments"]["runnerToShard"][runner].values()))


def _weight_fetches(hub: RunningHub) -> dict[str, set[str]]:
    """Weight file → the clients (node tags) that downloaded it with a plain GET."""
    fetched: dict[str, set[str]] = {}
    for line in hub.requests():
        match = re.fullmatch(r"GET /\S+/resolve/\S+/(\S+\.safetensors) - @(\S+)", line)
        if match is not None:
            fetched.setdefault(match.group(1), set()).add(match.group(2))
    return fetched


def test_each_pipeline_rank_downloads_only_the_files_of_its_layers(cluster: Cluster, tmp_path: Path) -> None:
    repo = write_random_model(tmp_path / "hub", MODEL, shards=FILES, layers=LAYERS)
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    sizes = {p.name: p.stat().st_size for p in repo.iterdir() if p.is_file() and is_needed(p.name)}
    hub = RunningHub(tmp_path / "hub").start()
    try:
        nodes: list[LocalNode] = [
            cluster.start(1, extra_env={"HF_ENDPOINT": hub.client_url(f"n{i}")}, place_default=False)[0]
            for i in range(3)
        ]
        tags = {node.node_id: f"n{i}" for i, node in enumerate(nodes)}
        host = nodes[0]
        wait_until(lambda: len((host.get("/state") or {}).get("nodeIdentities", {})) == 3, 30, "three nodes")
        status, added = host.post("/models/add", {"model_id": MODEL})
        assert status == 200, added
        instance_id = place(host, MODEL, min_nodes=3)["instanceId"]
        wait_until(lambda: instance_ready(host, instance_id), 120, "the instance to be ready",
                   lambda: "\n----\n".join(n.log_tail(30) for n in nodes))

        state = host.get("/state")
        needed_by: dict[str, set[str]] = {}
        for node in nodes:
            shard = _my_shard(state, instance_id, node.node_id)
            layers = (shard["startLayer"], shard["endLayer"], shard["nLayers"])
            assert layers[:2] != (0, LAYERS), "each node holds a part of the model"
            expected = files_for_shard(sizes, index, layers)
            weights = {n for n in expected if n.endswith(".safetensors")}
            for name in weights:
                needed_by.setdefault(name, set()).add(tags[node.node_id])
            staged = node.home / "staging" / "org--tiny-hub-shards"
            assert {p.name for p in staged.glob("*.safetensors")} == weights, f"node {tags[node.node_id]} {layers}"
            assert (staged / "config.json").is_file() and (staged / "model.safetensors.index.json").is_file()
            assert not (node.home / "models" / "org--tiny-hub-shards").exists(), "no whole copy in store_path"
            progress = state["downloads"][node.node_id][MODEL]
            assert (progress["status"], progress["source"]) == ("Completed", "huggingface")
            assert progress["totalBytes"] == progress["downloadedBytes"] == sum(expected.values())
            assert progress["filesTotal"] == len(expected)
            assert progress["totalBytes"] < sum(sizes.values()), "the bytes of this node's share, not the model's"

        assert _weight_fetches(hub) == needed_by, hub.requests()
        assert sum(len(v) for v in needed_by.values()) < FILES * len(nodes), "not every node fetched every file"

        status, reply = nodes[2].post("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
    finally:
        hub.kill()
