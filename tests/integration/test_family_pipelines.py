"""The torch engine's families as a Pipeline over THREE real node processes (issue 40): each family's 16
greedy tokens, with their logprobs, are transformers' own forward's on the same prompt ids.

The unit tests hold each family to transformers through in-process stages (test_glm4_moe's
assert_transformers_tokens) and test_mlx_families over two node processes; here the hidden states cross two real
boundaries between processes that each built only their own layers, with each family's mixed layer kinds split
over different ranks:
- GLM-4 MoE (test_glm4_moe's grouped variant: q/k norm and biases, expert groups, two shared experts): a dense first
  layer, then MoE layers;
- gpt-oss (test_gpt_oss's variant: every bias drawn, clamped SwiGLU): full, sliding, sliding, full attention;
- Qwen3.5 MoE (test_qwen3_5's, the published multimodal layout): gated DeltaNet and full attention alternating;
- DeepSeek V3 (family_checkpoints'): MLA (its one latent cached whole on every rank), a dense first layer, then MoE;
- Nemotron-H (family_checkpoints'), which the torch engine runs through transformers' own modeling (the fallback):
  Mamba, attention, Mamba and MLP blocks, each rank building only its own (fallback_stage.py).
Seeded random float32 checkpoints, served by the local stand-in hub to three nodes whose only engine is torch
(SKULK_ENGINES=torch, as test_mlx_families' torch-only node), started once for the module; each family is placed,
compared and deleted in turn (one instance at a time). Tokens must be equal, as test_mlx_families asks: at each of
the 16 steps transformers' top two logprobs differ by 0.026 at least (measured for these seeds), far past float32
noise. Most of a family's time is its three ranks' start (each imports torch and transformers: ~7 CPU-s a rank)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skulk.testing.nodes import LocalNode
from tests.fake_hub import RunningHub
from tests.unit.test_glm4_moe import one_thread  # noqa: F401 - autouse: one torch thread for the references

from .harness import Cluster, instance_ready, place, wait_until
from .test_mlx_families import assert_same_tokens, greedy, reference

pytestmark = pytest.mark.timeout(180)


def _glm4_moe(root: Path, demo: Path) -> Path:
    from tests.unit.test_glm4_moe import _write_grouped

    return _write_grouped(root, demo)


def _gpt_oss(root: Path, demo: Path) -> Path:
    from tests.unit.test_gpt_oss import _write_variant

    return _write_variant(root, demo)


def _qwen3_5_moe(root: Path, demo: Path) -> Path:
    from tests.unit.test_qwen3_5 import _write

    return _write(root, demo, moe=True)


def _deepseek_v3(root: Path, demo: Path) -> Path:
    from tests.unit.family_checkpoints import write

    return write("deepseek_v3", root, demo)


def _nemotron_h(root: Path, demo: Path) -> Path:
    from tests.unit.family_checkpoints import write

    return write("nemotron_h", root, demo)


WRITERS: dict[str, Callable[[Path, Path], Path]] = {
    "org/tiny-glm4-moe": _glm4_moe, "org/tiny-gpt-oss": _gpt_oss, "org/tiny-qwen3.5-moe": _qwen3_5_moe,
    "org/tiny-deepseek-v3": _deepseek_v3, "org/tiny-nemotron-h": _nemotron_h,
}
FALLBACK = {"org/tiny-nemotron-h"}
"""Families the torch engine runs through transformers' modeling (engines/torch/fallback.py), split by
fallback_stage.py: Nemotron-H's Mamba, attention and MLP blocks, one kind per rank at least."""
"""Per model id: (scratch root, tokenizer donor) -> its checkpoint's directory, which the fixture moves into the
hub. Qwen3-Next is left out for the suite's time (three more rank starts, ~20 CPU-s): its torch Pipeline over two
nodes is test_mlx_families', its three stages test_qwen3_next's, and Qwen3.5 holds the same DeltaNet-then-attention
split here."""


def layer_kinds(repo: Path) -> list[str]:
    """Each layer's kind as the checkpoint's config says: dense or MoE where the first layers are dense, else the
    attention kind of each (layer_types, in text_config for Qwen3.5's multimodal layout)."""
    config = json.loads((repo / "config.json").read_text())
    config = config.get("text_config", config)
    if "layers_block_type" in config:  # Nemotron-H: mamba ("linear_attention"), attention, mlp
        return list(config["layers_block_type"])
    if "first_k_dense_replace" in config:
        dense = config["first_k_dense_replace"]
        return ["dense"] * dense + ["moe"] * (config["num_hidden_layers"] - dense)
    return list(config["layer_types"])


@dataclass
class Served:
    nodes: list[LocalNode]
    expected: dict[str, list[tuple[str, float]]]
    """Per model, transformers' greedy tokens (text, logprob) for test_mlx_families' chat prompt."""
    kinds: dict[str, list[str]]


def _write_all(hub: Path, scratch: Path) -> tuple[dict[str, list[tuple[str, float]]], dict[str, list[str]]]:
    """Every family's checkpoint in the hub; transformers' greedy tokens for each and its layers' kinds."""
    from tests.unit.family_checkpoints import tokenizer_donor

    demo = tokenizer_donor(scratch)
    expected, kinds = {}, {}
    for model_id, write in WRITERS.items():
        repo = hub / model_id.replace("/", "--")
        shutil.move(write(scratch / repo.name, demo), repo)
        expected[model_id], kinds[model_id] = reference(repo), layer_kinds(repo)
    return expected, kinds


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Three formed torch-only nodes, and the families in the hub with their expected tokens. The checkpoints are
    written while the nodes start (their imports take the other core): the hub serves what its directory holds
    when asked, and nothing is asked before the first test adds a model."""
    root = tmp_path_factory.mktemp("family-pipelines")
    (root / "hub").mkdir()
    hub = RunningHub(root / "hub").start()
    cluster = Cluster(root / "nodes", extra_env={"HF_ENDPOINT": hub.url, "SKULK_ENGINES": "torch"})
    try:
        with ThreadPoolExecutor(1) as pool:
            forming = pool.submit(cluster.form, 3, 120, place_default=False)
            expected, kinds = _write_all(root / "hub", root / "scratch")
            nodes = forming.result()
        yield Served(nodes, expected, kinds)
    except BaseException:
        cluster.print_logs()
        raise
    finally:
        hub.kill()
        assert cluster.stop_all() == [], "runner processes outlived their node"


def _layer_ranges(instance: dict[str, Any]) -> list[tuple[int, int]]:
    """Each rank's [start, end) layers, in rank order, as the placement records them."""
    shards = [next(iter(s.values())) for s in instance["shardAssignments"]["runnerToShard"].values()]
    assert {next(iter(s)) for s in instance["shardAssignments"]["runnerToShard"].values()} == {"PipelineShardMetadata"}
    return [(s["startLayer"], s["endLayer"]) for s in sorted(shards, key=lambda s: s["deviceRank"])]


@pytest.mark.parametrize("model_id", list(WRITERS), ids=[m.split("/")[1] for m in WRITERS])
def test_a_pipeline_over_three_torch_nodes_gives_transformers_tokens(served: Served, model_id: str) -> None:
    """Placed as a torch Pipeline over the three nodes, each rank one or two layers, the ranks holding different
    kinds of layer; 16 greedy tokens with transformers' logprobs; then deleted, and the next family waits for its
    runners to be gone."""
    node = served.nodes[0]
    status, added = node.post("/models/add", {"model_id": model_id})
    runtime = "transformers" if model_id in FALLBACK else "native"
    assert status == 200 and added["torch_runtime"] == runtime, added
    wait_until(lambda: not any(n.runner_pids() for n in served.nodes) or None, 60, "the earlier instance to stop")
    placed = place(node, model_id, min_nodes=3, sharding="Pipeline", engine="torch")
    instance = next(iter(placed["instance"].values()))
    try:
        assert instance["engine"] == "torch", instance
        ranges, kinds = _layer_ranges(instance), served.kinds[model_id]
        assert len(ranges) == 3 and all(b > a for a, b in ranges), ranges
        assert [a for a, _ in ranges] == [0, *(b for _, b in ranges[:-1])] and ranges[-1][1] == len(kinds), ranges
        assert len({frozenset(kinds[a:b]) for a, b in ranges}) > 1, f"every rank holds the same kinds: {ranges}"
        wait_until(lambda: instance_ready(node, placed["instanceId"]), 120, f"the {model_id} instance",
                   lambda: "".join(n.log_tail(20) for n in served.nodes))
        assert_same_tokens(greedy(node, model_id), served.expected[model_id])
    finally:
        with node.client() as client:
            assert client.delete(f"/instance/{placed['instanceId']}").status_code == 200
