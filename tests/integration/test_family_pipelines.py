"""The torch engine's native families as a Pipeline over THREE real node processes (issue 40): each family's 16
greedy tokens, with their logprobs, are transformers' own forward's on the same prompt ids.

The unit tests hold each family to transformers through in-process stages (test_glm4_moe's
assert_transformers_tokens) and test_mlx_families over two node processes; here the hidden states cross two real
boundaries between processes that each built only their own layers, with each family's mixed layer kinds split
over different ranks:
- GLM-4 MoE (test_glm4_moe's grouped variant: q/k norm and biases, expert groups, two shared experts): a dense first
  layer, then MoE layers;
- gpt-oss (test_gpt_oss's variant: every bias drawn, clamped SwiGLU): full, sliding, sliding, full attention;
- Qwen3.5 MoE (test_qwen3_5's, the published multimodal layout): gated DeltaNet and full attention alternating;
- DeepSeek V3 (family_checkpoints'): MLA, a dense first layer, then MoE;
- Qwen3-Next (family_checkpoints'): three gated DeltaNet layers, then one full attention layer.
Seeded random float32 checkpoints, served by the local stand-in hub to three nodes whose only engine is torch
(SKULK_ENGINES=torch, as test_mlx_families' torch-only node), started once for the module; each family is placed,
compared and deleted in turn (one instance at a time)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skulk.testing.nodes import LocalNode
from tests.fake_hub import RunningHub

from .harness import Cluster, instance_ready, place, wait_until
from .test_mlx_families import assert_same_tokens, greedy, reference

pytestmark = pytest.mark.timeout(180)


@dataclass(frozen=True)
class Family:
    model_id: str
    write: Callable[[Path, Path], Path]
    """(scratch root, tokenizer donor) -> the checkpoint's directory, which the fixture moves into the hub."""
    kinds: tuple[str, ...]
    """Each layer's kind (attention or MLP): the 3-way split must put different kinds on different ranks."""


def _glm4_moe(root: Path, demo: Path) -> Path:
    from tests.unit.test_glm4_moe import _write_grouped

    return _write_grouped(root, demo)


def _gpt_oss(root: Path, demo: Path) -> Path:
    from tests.unit.test_gpt_oss import _write_variant

    return _write_variant(root, demo)


def _qwen3_5_moe(root: Path, demo: Path) -> Path:
    from tests.unit.test_qwen3_5 import _write

    return _write(root, demo, moe=True)


def _shared(name: str) -> Callable[[Path, Path], Path]:
    def write_it(root: Path, demo: Path) -> Path:
        from tests.unit.family_checkpoints import write

        return write(name, root, demo)

    return write_it


FAMILIES = [
    Family("org/tiny-glm4-moe", _glm4_moe, ("dense", "moe", "moe")),
    Family("org/tiny-gpt-oss", _gpt_oss, ("full", "sliding", "sliding", "full")),
    Family("org/tiny-qwen3.5-moe", _qwen3_5_moe, ("linear", "full", "linear", "full")),
    Family("org/tiny-deepseek-v3", _shared("deepseek_v3"), ("dense", "moe", "moe")),
    Family("org/tiny-qwen3-next", _shared("qwen3_next"), ("linear", "linear", "linear", "full")),
]


@dataclass
class Served:
    nodes: list[LocalNode]
    expected: dict[str, list[tuple[str, float]]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Every family's checkpoint in the hub with transformers' tokens for it, and three formed torch-only nodes."""
    from tests.unit.family_checkpoints import tokenizer_donor

    root = tmp_path_factory.mktemp("family-pipelines")
    demo = tokenizer_donor(root / "scratch")
    expected = {}
    for family in FAMILIES:
        repo = root / "hub" / family.model_id.replace("/", "--")
        shutil.move(family.write(root / "scratch" / repo.name, demo), repo)
        expected[family.model_id] = reference(repo)
    hub = RunningHub(root / "hub").start()
    cluster = Cluster(root / "nodes", extra_env={"HF_ENDPOINT": hub.url, "SKULK_ENGINES": "torch"})
    try:
        yield Served(cluster.form(3, timeout=120, place_default=False), expected)
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


@pytest.mark.parametrize("family", FAMILIES, ids=[f.model_id.split("/")[1] for f in FAMILIES])
def test_a_pipeline_over_three_torch_nodes_gives_transformers_tokens(served: Served, family: Family) -> None:
    node = served.nodes[0]
    status, added = node.post("/models/add", {"model_id": family.model_id})
    assert status == 200 and added["torch_runtime"] == "native", added
    wait_until(lambda: not any(n.runner_pids() for n in served.nodes) or None, 60, "the earlier instance to stop")
    placed = place(node, family.model_id, min_nodes=3, sharding="Pipeline", engine="torch")
    instance = next(iter(placed["instance"].values()))
    try:
        assert instance["engine"] == "torch" and len(instance["shardAssignments"]["nodeToRunner"]) == 3
        ranges = _layer_ranges(instance)
        layers = len(family.kinds)
        assert [a for a, _ in ranges] == [0, *(b for _, b in ranges[:-1])] and ranges[-1][1] == layers, ranges
        assert all(b > a for a, b in ranges), ranges
        held = {frozenset(family.kinds[a:b]) for a, b in ranges}
        assert len(held) > 1, f"every rank holds the same layer kinds: {ranges}"
        wait_until(lambda: instance_ready(node, placed["instanceId"]), 120, f"the {family.model_id} instance",
                   lambda: "".join(n.log_tail(20) for n in served.nodes))
        assert_same_tokens(greedy(node, family.model_id), served.expected[family.model_id])
    finally:
        with node.client() as client:
            assert client.delete(f"/instance/{placed['instanceId']}").status_code == 200

