"""KV cache in 8 and 4 bits through a real node (issue 41): instances of the built-in random model placed with
kv_cache_bits 8 and 4 answer a chat, their runners building quantized pools (the flight recorder's kv_cache_lookup
says at which bits); the node's SKULK_KV_CACHE_BITS is the bits of a placement that sets none. One node for the
file; each test places, chats and deletes its instance."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
NODE_DEFAULT = 4
PER_TOKEN = {16: 2 * 8 * 2 * 16 * 4, 8: 2 * 8 * 2 * (16 + 2), 4: 2 * 8 * 2 * (8 + 2)}
"""The demo model's KV bytes a position: 8 layers, 2 KV heads of 16, float32 (or int8 / int4 and their scales)."""
POOL = 1 << 20
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    cluster = Cluster(tmp_path_factory.mktemp("kvbits"))
    try:
        (started,) = cluster.start(1, extra_env={"SKULK_KV_CACHE_BITS": str(NODE_DEFAULT)})
        wait_until(lambda: started.node_id in (started.get("/state") or {}).get("nodeMemory", {}), 60, "memory info")
        yield started
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def _chat(node: LocalNode, instance_id: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The instance's card, its runner's pool as the flight recorder's kv_cache_lookup saw it, and the pool placement
    reserved, after a chat the instance answers."""
    try:
        instance = node.get(f"/instance/{instance_id}")["MlxRingInstance"]
        (shard,) = instance["shardAssignments"]["runnerToShard"].values()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
                "temperature": 0}
        status, reply = node.post("/v1/chat/completions", body, timeout=60)
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] > 0

        def lookups() -> list[dict[str, Any]]:
            runners = node.get("/v1/diagnostics/node").get("supervisorRunners") or []
            return [e["attrs"] for r in runners if r["instanceId"] == instance_id for e in r["flightRecorder"]
                    if e["phase"] == "kv_cache_lookup"]

        pool = wait_until(lookups, 30, "a kv_cache_lookup entry")[-1]
        return next(iter(shard.values()))["modelCard"], pool, next(iter(instance["kvCacheBytes"].values()))
    finally:
        httpx.delete(f"{node.url}/instance/{instance_id}", timeout=30)
        wait_until(lambda: instance_id not in (node.get("/state") or {}).get("instances", {}), 30, "the delete")


@pytest.mark.parametrize("bits", [8, 4])
def test_an_instance_at_fewer_bits_answers_a_chat(node: LocalNode, bits: int) -> None:
    instance_id = place_and_wait(node, MODEL, kv_cache_bits=bits, max_context=256, kv_cache_gb=POOL / 2**30)
    card, pool, reserved = _chat(node, instance_id)
    assert card["kvCacheBits"] == pool["kv_bits"] == bits
    assert POOL - PER_TOKEN[bits] < reserved <= POOL  # whole positions of kv_cache_gb
    block = pool["kv_block_size"] * PER_TOKEN[bits]
    assert reserved - block < pool["kv_blocks"] * block <= reserved  # the runner's pool is the one placement counted


def test_the_nodes_default_is_a_placements_bits_when_it_sets_none(node: LocalNode) -> None:
    instance_id = place_and_wait(node, MODEL, max_context=256, kv_cache_gb=POOL / 2**30)
    card, pool, _ = _chat(node, instance_id)
    assert card["kvCacheBits"] == pool["kv_bits"] == NODE_DEFAULT


def test_previews_count_the_smaller_pool(node: LocalNode) -> None:
    pools = {}
    for bits in (16, 8, 4):
        with node.client() as client:
            previews = client.get("/instance/previews", params={"model_id": MODEL, "kv_cache_bits": bits,
                                                                "max_context": 2048, "sharding": "Pipeline"})
        assert previews.status_code == 200, previews.text
        (usable,) = [p for p in previews.json()["previews"] if p["error"] is None]
        pools[bits] = usable["kv_cache_bytes_by_node"][node.node_id]
    assert pools[16] / PER_TOKEN[16] == pools[8] / PER_TOKEN[8] == pools[4] / PER_TOKEN[4]  # 64 whole contexts
