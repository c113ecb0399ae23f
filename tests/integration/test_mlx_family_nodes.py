"""The families on the MLX engine over THREE and TWO real node processes (issue 40): each family's 16 greedy
tokens, with their logprobs, are transformers' own forward's on the same prompt ids.

test_mlx_family_parity and test_mlx_family_rings hold every family to transformers on MLX ranks that are
processes of one test; test_mlx_families crosses real nodes with DeepSeek-V3 and Qwen3-Next over two. Here each
family that mlx-lm loads and splits runs as a Pipeline over three nodes, a Pipeline over two and, where its card
offers it (mlx-lm's model has shard()), Tensor over two, so the hidden states cross real boundaries between node
processes that each loaded only their slice through the runner:
- DeepSeek-V3 (MLA, a dense first layer then MoE) and GLM-4 MoE (dense then MoE): all three layouts, the dense
  layer and the MoE layers on different ranks;
- Qwen3-Next (gated DeltaNet layers, then full attention): both Pipelines, the DeltaNet and attention layers on
  different ranks (mlx-lm's PipelineMixin re-derives the attention layer's index in a later rank's slice);
  Tensor refused (no shard());
- Qwen3-MoE, MiniMax-M2 (all three) and Mixtral (both Pipelines; no shard(): Tensor refused), MoE stacks of one
  kind.
The families whose card offers no split on MLX (Nemotron-H: Mamba, attention and MLP blocks; Gemma 4, both the
E2B/E4B kind and the 26B-A4B MoE kind: sliding and full attention; each a plain mlx-lm stack indexed by position,
no shard()) are refused by placement with a
typed 400 naming why, over two ranks and three. Left out: gpt-oss and Llama 4, whose transformers-5 float
layouts mlx-lm's loader does not read (its gpt_oss sanitize splits only the published MXFP4 experts; its
llama4_text expects the published expert names), so no MLX rank runs them at all.

The three layouts of a family run at once, each under its own model id (a copy of the checkpoint in the stand-in
hub: the API routes a request by model id, so one id per instance is how a test reaches each), seven runners on
three nodes: their starts overlap instead of queueing. Seeded random float32 checkpoints (mlx[cpu]'s GatherMM takes
float32 only) from tests/unit/family_checkpoints, written while the nodes start. Measured alone (-n 0 on the
shared 2-core machine): 284 s at load average 6-12 (29-51 s a family, most of it seven runner starts, each
importing torch and mlx-lm; 13 s to form the nodes), 341 s at 9-14 (50 s to form). The MLX two-node cases
test_mlx_families had (DeepSeek-V3's Pipeline and Tensor, Qwen3-Next's Pipeline) are these now, and gone from
there."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skulk.testing.nodes import LocalNode

from .harness import hub_and_nodes, instance_ready, place, wait_until
from .test_mlx_families import assert_same_tokens, greedy, reference

pytest.importorskip("mlx_lm")

pytestmark = pytest.mark.timeout(240)

SPLIT = {"deepseek_v3": True, "glm4_moe": True, "qwen3_next": False, "qwen3_moe": True, "minimax_m2": True,
         "mixtral": False}
"""The families MLX splits, and whether mlx-lm's model has shard() (Tensor over two offered)."""
REFUSED = ["nemotron_h", "gemma4_text", "gemma4_moe"]
"""Families mlx-lm runs on one rank but cannot split: mixed layers in a stack indexed by position, no shard()."""
LAYOUTS = {"p3": (3, "Pipeline"), "p2": (2, "Pipeline"), "t2": (2, "Tensor")}
"""Per layout: the model id's suffix, and (nodes, sharding)."""


def model_id(family: str, layout: str) -> str:
    return f"org/{family.replace('_', '-')}-{layout}"


def layer_kinds(repo: Path) -> list[str]:
    """Each layer's kind as the checkpoint's config says: dense or MoE where the first layers are dense, else
    each layer's type where the config lists them, else one kind (a uniform MoE stack)."""
    config = json.loads((repo / "config.json").read_text())
    n = int(config["num_hidden_layers"])
    if "first_k_dense_replace" in config:
        dense = int(config["first_k_dense_replace"])
        return ["dense"] * dense + ["moe"] * (n - dense)
    return list(config.get("layer_types") or ["moe"] * n)


@dataclass
class Served:
    nodes: list[LocalNode]
    expected: dict[str, list[tuple[str, float]]]
    """Per family, transformers' greedy tokens (text, logprob) for test_mlx_families' chat prompt."""
    kinds: dict[str, list[str]]


def _write_all(hub: Path, scratch: Path) -> tuple[dict[str, list[tuple[str, float]]], dict[str, list[str]]]:
    """Every split family's checkpoint in the hub under each layout's id, with transformers' greedy tokens and
    its layers' kinds; the refused families' config and tokenizer beside a one-number safetensors file (the
    card is all placement reads, and adding a model asks for safetensors; Gemma 4's real checkpoint here would
    be 1 GB: its per-layer embeddings span a 262k vocabulary)."""
    import numpy as np
    import transformers
    from safetensors.numpy import save_file

    from tests.unit.family_checkpoints import COMMON, FAMILIES, MORE, tokenizer_donor, with_tokenizer, write

    demo = tokenizer_donor(scratch)
    expected, kinds = {}, {}
    for family in SPLIT:
        repo = write(family, scratch, demo)
        expected[family], kinds[family] = reference(repo), layer_kinds(repo)
        for layout in LAYOUTS:
            shutil.copytree(repo, hub / model_id(family, layout).replace("/", "--"))
    for family in REFUSED:
        config_cls, _, shape = (FAMILIES | MORE)[family]
        repo = scratch / family
        getattr(transformers, config_cls)(**(COMMON | shape)).save_pretrained(repo)
        save_file({"placeholder": np.zeros(1, np.float32)}, str(repo / "model.safetensors"))
        with_tokenizer(repo, demo)
        shutil.copytree(repo, hub / model_id(family, "any").replace("/", "--"))
    return expected, kinds


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Three formed nodes with the MLX engine (as test_mlx_families' MLX nodes), and the families in the hub
    with their expected tokens, written while the nodes start: the hub serves what its directory holds when
    asked, and nothing is asked before a test adds a model."""
    root = tmp_path_factory.mktemp("mlx-family-nodes")
    with hub_and_nodes(root, 3, _write_all) as (nodes, (expected, kinds)):
        yield Served(nodes, expected, kinds)


def _layer_ranges(instance: dict[str, Any]) -> list[tuple[int, int]]:
    """Each rank's [start, end) layers, in rank order, as a Pipeline placement records them."""
    shards = [next(iter(s.values())) for s in instance["shardAssignments"]["runnerToShard"].values()]
    assert {next(iter(s)) for s in instance["shardAssignments"]["runnerToShard"].values()} == {"PipelineShardMetadata"}
    return [(s["startLayer"], s["endLayer"]) for s in sorted(shards, key=lambda s: s["deviceRank"])]


def _check_pipeline(instance: dict[str, Any], ranks: int, kinds: list[str]) -> None:
    """The ranks cover the layers in order, one or more each, and where the family's layers differ in kind the
    ranks hold different kinds (the boundary between kinds crosses nodes)."""
    ranges = _layer_ranges(instance)
    assert len(ranges) == ranks and all(b > a for a, b in ranges), ranges
    assert [a for a, _ in ranges] == [0, *(b for _, b in ranges[:-1])] and ranges[-1][1] == len(kinds), ranges
    if len(set(kinds)) > 1:
        assert len({frozenset(kinds[a:b]) for a, b in ranges}) > 1, f"every rank holds the same kinds: {ranges}"


def _add(node: LocalNode, model: str) -> dict[str, Any]:
    status, added = node.post("/models/add", {"model_id": model})
    assert status == 200 and added["compatible_backends"] is None, added
    return added


@pytest.mark.parametrize("family", list(SPLIT))
def test_a_family_over_three_and_two_mlx_nodes_gives_transformers_tokens(served: Served, family: str) -> None:
    """Its Pipeline over three nodes, over two and (where offered) Tensor over two placed at once, each giving
    transformers' 16 greedy tokens and logprobs; Tensor refused with mlx-lm's reason where it has no shard().
    Every instance is deleted and its runners gone before the next family."""
    node = served.nodes[0]
    wait_until(lambda: not any(n.runner_pids() for n in served.nodes) or None, 60, "the earlier instances to stop")
    placed: dict[str, dict[str, Any]] = {}
    try:
        for layout, (ranks, sharding) in LAYOUTS.items():
            model = model_id(family, layout)
            assert _add(node, model)["family"] == family
            if sharding == "Tensor" and not SPLIT[family]:
                status, reply = node.post("/place_instance", {"model_id": model, "min_nodes": ranks,
                                                              "sharding": sharding, "engine": "mlx"})
                assert status == 400 and reply["error"]["code"] == "EngineUnavailable", reply
                assert "mlx-lm cannot split model" in str(reply) and "no shard()" in str(reply), reply
                continue
            placed[model] = place(node, model, min_nodes=ranks, sharding=sharding, engine="mlx")
            instance = next(iter(placed[model]["instance"].values()))
            assert instance["engine"] == "mlx" and len(instance["shardAssignments"]["nodeToRunner"]) == ranks
            if sharding == "Pipeline":
                _check_pipeline(instance, ranks, served.kinds[family])
        for model, reply in placed.items():
            wait_until(lambda r=reply: instance_ready(node, r["instanceId"]), 180, f"the {model} instance",
                       lambda: "".join(n.log_tail(20) for n in served.nodes))
        with ThreadPoolExecutor(len(placed)) as pool:  # the instances answer at once: each step is mostly waiting
            answers = dict(zip(placed, pool.map(lambda m: greedy(node, m), placed), strict=True))
        for model, got in answers.items():
            try:
                assert_same_tokens(got, served.expected[family])
            except AssertionError as e:
                raise AssertionError(f"{model}: {e}") from None
    finally:
        with node.client() as client:
            for reply in placed.values():
                assert client.delete(f"/instance/{reply['instanceId']}").status_code == 200


@pytest.mark.parametrize("family", REFUSED)
def test_a_family_mlx_cannot_split_is_refused_with_why(served: Served, family: str) -> None:
    """Placement refuses it (a typed 400, before any runner starts) over three nodes and two, either sharding,
    naming the reason: its layers differ in kind in a stack mlx-lm indexes by position; no shard()."""
    node = served.nodes[0]
    model = model_id(family, "any")
    assert _add(node, model)["family"] == {"gemma4_moe": "gemma4_text"}.get(family, family)  # its model type
    for ranks, sharding, why in ((3, "Pipeline", "differ in kind"), (2, "Pipeline", "differ in kind"),
                                 (2, "Tensor", "no shard()")):
        status, reply = node.post("/place_instance", {"model_id": model, "min_nodes": ranks, "sharding": sharding,
                                                      "engine": "mlx"})
        assert status == 400 and reply["error"]["code"] == "EngineUnavailable", reply
        assert "mlx-lm cannot split model" in str(reply) and why in str(reply), (sharding, reply)
        assert f"over {ranks} ranks" in str(reply), reply
    assert not any(n.runner_pids() for n in served.nodes)
