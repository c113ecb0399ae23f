"""Numerics that survive a split (issue 41): the real default model (SmolLM2-135M-Instruct, the packaged GGUF `make run`
serves) gives the same greedy text on one node, as a Pipeline over 3 nodes and as a Tensor split over 3 (Pipeline
over 2 is a sub-case of 3: one boundary instead of two; test_cluster covers it through nodes), for the README's curl
question and "What is the capital of France?", and that text answers Paris. While the logits were rounded to bf16,
'The' and 'L' tied on the second question: the issue measured Tensor 3 of the bf16 checkpoint answering "L'Étoile, la
Marseillaise," where one node said "The capital of France is Paris."; with this GGUF one node itself answered
"L'Étoile, la Marseillaise, la femme, la femme au martyre, la" (which placement picks which token of a tie is the
accident this removes). Tensor over 2 cannot split SmolLM2's 9 attention heads; placement refuses it.

Three node processes serve every placement in turn (one instance at a time), started once for the file."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from skulk.models.packaged import CACHE_ENV, DEFAULT_MODEL_ID, SMOLLM2, fetch_gguf, shared_cache
from skulk.testing.nodes import LocalNode

from .harness import Cluster, instance_ready, place, wait_until

pytestmark = pytest.mark.timeout(600)

QUESTIONS = ("What is the capital of France? Answer in one word.",  # README.md's curl line
             "What is the capital of France?")
TOKENS = 24  # the README's max_tokens
READY_S = 400
"""Placing and loading on a loaded 2-core machine: every member imports the GGUF into its home and its runner
compiles the CPU kernels on first use."""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalNode]]:
    gguf = fetch_gguf(SMOLLM2, shared_cache())  # the documented path, once per machine (make run shares it)
    cluster = Cluster(tmp_path_factory.mktemp("split"), extra_env={CACHE_ENV: str(gguf.parent.parent)})
    try:
        yield cluster.form(3, timeout=120)
    except BaseException:
        cluster.print_logs()
        raise
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def _replace(node: LocalNode, **body: Any) -> str:
    """The model's instances deleted, then one placed as body asks; its id once every runner is ready."""
    state = node.get("/state", timeout=10) or {}
    with node.client() as client:
        for old in state.get("instances") or {}:
            assert client.delete(f"/instance/{old}").status_code == 200
    instance_id = place(node, DEFAULT_MODEL_ID, **body)["instanceId"]
    wait_until(lambda: instance_ready(node, instance_id), READY_S, f"{body} to be ready", lambda: node.log_tail(30))
    return instance_id


def _world(node: LocalNode, instance_id: str) -> tuple[str, int]:
    """(the instance's shard kind, its number of ranks) as the cluster's state records it."""
    instance = next(iter((node.get("/state", timeout=10) or {})["instances"][instance_id].values()))
    shards = instance["shardAssignments"]["runnerToShard"].values()
    return next(iter(next(iter(shards)))), len(instance["shardAssignments"]["nodeToRunner"])


def _answers(node: LocalNode) -> list[str]:
    texts = []
    for question in QUESTIONS:
        body = {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": question}], "temperature": 0,
                "max_tokens": TOKENS}
        status, reply = node.post("/v1/chat/completions", body, timeout=180)
        assert status == 200, reply
        texts.append(reply["choices"][0]["message"]["content"])
    return texts


@pytest.fixture(scope="module")
def one_node(nodes: list[LocalNode]) -> list[str]:
    a, b, c = nodes
    _replace(a, excluded_nodes=[b.node_id, c.node_id])
    texts = _answers(a)
    print("one node:", texts)
    assert "Paris" in texts[0] and "Paris" in texts[1], texts
    return texts


@pytest.mark.parametrize(("sharding", "ranks"), [("Pipeline", 3), ("Tensor", 3)], ids=["pipeline3", "tensor3"])
def test_a_split_gives_the_one_node_text(nodes: list[LocalNode], one_node: list[str], sharding: str,
                                         ranks: int) -> None:
    instance_id = _replace(nodes[0], sharding=sharding, min_nodes=ranks)
    kind, world = _world(nodes[0], instance_id)
    assert kind == f"{sharding}ShardMetadata" and world == ranks
    texts = _answers(nodes[0])
    print(f"{sharding} {ranks}:", texts)
    assert texts == one_node
