"""Previews tell the truth (issue 41): once a node's runners have measured their runtime overhead, a single-node
preview's bytes for that node are within 5 % of what the runner then holds resident, for three families whose
memory differs in kind: a dense Llama, a Qwen3 mixture of experts, and Gemma 3 with sliding-window layers.

The preview counts the rank's exact weights (the card's per-layer bytes), its KV pool (here small enough to be
zeroed, so resident, when allocated) and the runtime overhead this node's runners reported (nodeMemory's
runnerOverheads, measured by the runner once warm: its RSS less its weights and zeroed KV). Real node processes,
real checkpoints in the families' Hugging Face layouts with random weights, served from the local hub stand-in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skulk.models.demo import DEMO_MODEL_ID, ensure_demo_model
from skulk.testing.memory import delete_instance, process_memory
from skulk.testing.nodes import LocalNode
from tests.fake_hub import RunningHub, write_random_model
from tests.unit.family_checkpoints import with_tokenizer

from .harness import Cluster, instance_ready, place_and_wait, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

KV_CACHE_GB = 0.02
"""A pool whose per-layer tensors are under cache.ZEROED_BELOW: zeroed at allocation, so resident after load."""
MAX_CONTEXT = 256
TOLERANCE = 0.05
FAMILIES = {
    "org/moe-qwen3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 4,
        "num_experts": 16, "num_experts_per_tok": 2, "head_dim": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2}),
    "org/sliding-gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "head_dim": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 64}),
}
DENSE = "org/dense-llama"


@dataclass
class Served:
    node: LocalNode
    hub: RunningHub


def _write_family(hub_root: Path, repo_id: str, demo: Path) -> None:
    import torch
    import transformers

    config_cls, model_cls, shape = FAMILIES[repo_id]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=260, max_position_embeddings=512, **shape)
    model = getattr(transformers, model_cls)(config).float().eval()
    repo = hub_root / repo_id.replace("/", "--")
    model.save_pretrained(repo)
    with_tokenizer(repo, demo)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("truth")
    demo = ensure_demo_model(root / "demo")
    write_random_model(root / "hub", DENSE, hidden=768, layers=8)
    for repo_id in FAMILIES:
        _write_family(root / "hub", repo_id, demo)
    hub = RunningHub(root / "hub").start()
    cluster = Cluster(root, extra_env={"HF_ENDPOINT": hub.url, "SKULK_SPECULATE": "0"})
    try:
        (node,) = cluster.start(1)
        yield Served(node, hub)
    finally:
        hub.kill()
        assert cluster.stop_all() == [], "runner processes outlived their node"


def _overheads(node: LocalNode) -> list[dict[str, Any]]:
    memory = (node.get("/state") or {}).get("nodeMemory", {}).get(node.node_id) or {}
    return memory.get("runnerOverheads") or []


def _preview_bytes(node: LocalNode, model_id: str) -> tuple[int, dict[str, Any]]:
    with node.client() as client:
        found = client.get("/instance/previews", params={
            "model_id": model_id, "sharding": "Pipeline", "engine": "torch", "kv_cache_gb": KV_CACHE_GB,
            "max_context": MAX_CONTEXT}).json()
    ones = [p for p in found["previews"] if p["error"] is None and len(p["memory_delta_by_node"]) == 1]
    assert ones, json.dumps(found)[:2000]
    return int(ones[0]["memory_delta_by_node"][node.node_id]), ones[0]


def _rss_once_ready(node: LocalNode, model_id: str) -> tuple[str, int]:
    status, placed = node.post("/place_instance", {"model_id": model_id, "sharding": "Pipeline", "engine": "torch",
                                                   "min_nodes": 1, "kv_cache_gb": KV_CACHE_GB,
                                                   "max_context": MAX_CONTEXT}, timeout=120)
    assert status == 200, placed
    instance_id = placed["instanceId"]
    wait_until(lambda: instance_ready(node, instance_id), 180, f"{model_id} to be ready", lambda: node.log_tail(30))
    (pid,) = node.runner_pids()
    return instance_id, process_memory(pid)["rss"]


def test_a_warm_runner_reports_its_overhead_and_previews_then_match_what_runners_hold(served: Served) -> None:
    node = served.node
    assert _overheads(node) == [], "nothing has loaded yet: no measured overhead"
    instance_id = place_and_wait(node, str(DEMO_MODEL_ID), kv_cache_gb=KV_CACHE_GB)
    wait_until(lambda: _overheads(node), 60, "the node to report its runner's measured overhead")
    (measured,) = _overheads(node)
    assert (measured["engine"], measured["role"]) == ("torch", "first")
    assert 100 * 2**20 < measured["overhead"]["inBytes"] < 2**30, measured  # an interpreter, torch, a tokenizer
    delete_instance(node, instance_id, [node])

    misses = []
    for model_id in (DENSE, *FAMILIES):
        status, added = node.post("/models/add", {"model_id": model_id}, timeout=120)
        assert status == 200, added
        predicted, preview = _preview_bytes(node, model_id)
        terms = {key: preview[f"{key}_by_node"][node.node_id] for key in (
            "weights_bytes", "runtime_bytes", "kv_cache_bytes", "runtime_measured")}
        assert terms["runtime_measured"], terms
        instance_id, rss = _rss_once_ready(node, model_id)
        try:
            error = predicted / rss - 1
            line = f"{model_id}: predicted {predicted / 2**20:.1f} MiB, resident {rss / 2**20:.1f} MiB ({error:+.1%})"
            print(line)
            if abs(error) > TOLERANCE:
                misses.append(f"{line}; terms {terms}")
        finally:
            delete_instance(node, instance_id, [node])
    assert not misses, "\n".join(misses)
