"""Issue 40's other families as torch Pipelines over real node processes, each over THREE nodes and over TWO: its
16 greedy tokens, with their logprobs, are transformers' own forward's on the same prompt ids.

test_family_pipelines.py holds GLM-4 MoE, gpt-oss, Qwen3.5 MoE, DeepSeek V3 and Nemotron-H; here, in a module of its
own so pytest-xdist (--dist loadfile) runs it beside that one:
- Qwen3-MoE, which the torch engine runs natively (engines/torch/models/qwen3_moe.py);
- Mixtral, MiniMax M2 and Llama 4 (chunked attention and a full layer without rope, MoE and dense layers
  interleaved), which it runs through transformers' own modeling (fallback.py, each rank building only its
  layers: fallback_stage.py);
- Gemma 4 as the cluster-sized 26B-A4B is shaped (family_checkpoints' gemma4_moe: sliding and full layers, a dense
  MLP and an MoE block in each, no per-layer inputs), also through the fallback. The E2B/E4B kind, whose layers
  read the token ids, is refused a split by design (families.fallback_splits) and is not placed here.
Each family's two instances are placed together (three ranks, then two on the first two nodes), so their five
ranks start at once, and the master routes a request to the oldest idle instance: the first request is served by
the three-rank one (the state's task says so), which is then deleted, and the second by the two-rank one. A runner
start costs ~7 CPU-s (torch and transformers imports); that, not the tokens, is most of each test's time.

Seeded random float32 checkpoints (family_checkpoints' shapes) served by the local stand-in hub to three nodes
whose only engine is torch, started once for the module. Seeds are chosen so that at each of the 16 steps
transformers' top two logprobs differ by GAP at least for this prompt (measured at seed 0: Mixtral's 0.007,
Qwen3-MoE's 0.020 and this Gemma 4's 0.001 were near-ties), and the fixture asserts it: equal tokens are then a
real check, far past float32 noise."""

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
from tests.fake_hub import RunningHub
from tests.unit.test_glm4_moe import one_thread  # noqa: F401 - autouse: one torch thread for the references

from .harness import Cluster, instance_ready, place, wait_until
from .test_family_pipelines import _layer_ranges
from .test_mlx_families import MESSAGES, TOKENS, assert_same_tokens, greedy

pytestmark = pytest.mark.timeout(240)

FAMILIES: dict[str, tuple[str, int]] = {
    "org/tiny-qwen3-moe": ("qwen3_moe", 2), "org/tiny-mixtral": ("mixtral", 2),
    "org/tiny-minimax-m2": ("minimax_m2", 0), "org/tiny-llama4": ("llama4_text", 0),
    "org/tiny-gemma4-moe": ("gemma4_moe", 3),
}
"""Per model id: its family_checkpoints name and seed (module docstring: why not always 0)."""
FALLBACK = {"org/tiny-mixtral", "org/tiny-minimax-m2", "org/tiny-llama4", "org/tiny-gemma4-moe"}
GAP = 0.02


def reference(repo: Path) -> list[tuple[str, float]]:
    """test_mlx_families.reference's greedy tokens (transformers' forward over the whole sequence each step, from
    the engines' own chat prompt ids), each step's top-two logprob gap asserted at least GAP."""
    import torch
    from transformers import AutoModelForCausalLM

    from skulk.engines.torch.tokenizer import ChatTokenizer
    from skulk.types.chat import ChatMessage

    tokenizer = ChatTokenizer(repo)
    ids = tokenizer.encode_chat([ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES])
    model = AutoModelForCausalLM.from_pretrained(str(repo), dtype=torch.float32).eval()
    out: list[tuple[str, float]] = []
    with torch.no_grad():
        for step in range(TOKENS):
            top = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1).topk(2)
            gap = float(top.values[0] - top.values[1])
            assert gap >= GAP, f"{repo.name}: a near-tie at step {step} ({gap:.4f}); pick another seed"
            token = int(top.indices[0])
            out.append((tokenizer.decode([token]), float(top.values[0])))
            ids.append(token)
    return out


def layer_kinds(repo: Path) -> list[str]:
    """Each layer's kind where the family mixes them (its attention kind, and MoE or dense where only some layers
    route: Llama 4's moe_layers); one kind for all where it does not (Mixtral, MiniMax M2, Qwen3-MoE)."""
    config = json.loads((repo / "config.json").read_text())
    n = config["num_hidden_layers"]
    attention = config.get("layer_types") or ["attention"] * n
    moe = config.get("moe_layers")
    return [f"{a}/{'moe' if moe is None or i in moe else 'dense'}" for i, a in enumerate(attention)]


@dataclass
class Served:
    nodes: list[LocalNode]
    expected: dict[str, list[tuple[str, float]]]
    kinds: dict[str, list[str]]


def _write_all(hub: Path, scratch: Path) -> tuple[dict[str, list[tuple[str, float]]], dict[str, list[str]]]:
    from tests.unit.family_checkpoints import tokenizer_donor, with_tokenizer, write_model

    demo = tokenizer_donor(scratch)
    expected, kinds = {}, {}
    for model_id, (name, seed) in FAMILIES.items():
        repo = hub / model_id.replace("/", "--")
        shutil.move(with_tokenizer(write_model(name, scratch / repo.name, seed=seed), demo), repo)
        expected[model_id], kinds[model_id] = reference(repo), layer_kinds(repo)
    return expected, kinds


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Three formed torch-only nodes, and the families in the hub with their expected tokens (written while the
    nodes start, as test_family_pipelines' fixture does)."""
    root = tmp_path_factory.mktemp("family-pipelines-two")
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


def _tasks_on(node: LocalNode, instance_id: str) -> int:
    """How many chat tasks the state holds on the instance (finished ones stay visible for a while)."""
    tasks = (node.get("/state", timeout=10) or {}).get("tasks", {}).values()
    bodies = [next(iter(t.values())) if len(t) == 1 and isinstance(next(iter(t.values())), dict) else t
              for t in tasks]
    return sum(1 for b in bodies if b.get("instanceId") == instance_id)


def _check_split(instance: dict[str, Any], kinds: list[str], ranks: int) -> None:
    """A torch Pipeline of `ranks` contiguous stages covering every layer; over three, where the family mixes
    kinds of layer, the ranks do not all hold the same kinds (over two, alternating layers such as Gemma 4's put
    both kinds on each rank, and both still cross the boundary)."""
    assert instance["engine"] == "torch", instance
    ranges = _layer_ranges(instance)
    assert len(ranges) == ranks and all(b > a for a, b in ranges), ranges
    assert [a for a, _ in ranges] == [0, *(b for _, b in ranges[:-1])] and ranges[-1][1] == len(kinds), ranges
    if ranks == 3 and len(set(kinds)) > 1:
        assert len({frozenset(kinds[a:b]) for a, b in ranges}) > 1, f"every rank holds the same kinds: {ranges}"


@pytest.mark.parametrize("model_id", list(FAMILIES), ids=[m.split("/")[1] for m in FAMILIES])
def test_a_pipeline_over_three_and_over_two_torch_nodes_gives_transformers_tokens(served: Served,
                                                                                   model_id: str) -> None:
    node, third = served.nodes[0], served.nodes[2]
    status, added = node.post("/models/add", {"model_id": model_id})
    runtime = "transformers" if model_id in FALLBACK else "native"
    assert status == 200 and added["torch_runtime"] == runtime, added
    wait_until(lambda: not any(n.runner_pids() for n in served.nodes) or None, 60, "the earlier instances to stop")
    body: dict[str, Any] = {"sharding": "Pipeline", "engine": "torch"}
    placed = [place(node, model_id, min_nodes=3, **body)]
    live = [placed[0]["instanceId"]]
    try:
        placed.append(place(node, model_id, min_nodes=2, excluded_nodes=[third.node_id], **body))
        live.append(placed[1]["instanceId"])
        for ranks, one in zip((3, 2), placed, strict=True):
            _check_split(next(iter(one["instance"].values())), served.kinds[model_id], ranks)
        wait_until(lambda: all(instance_ready(node, i) for i in live) or None, 150, f"the {model_id} instances",
                   lambda: "".join(n.log_tail(20) for n in served.nodes))
        for instance_id in list(live):
            before = _tasks_on(node, instance_id)
            assert_same_tokens(greedy(node, model_id), served.expected[model_id])
            assert _tasks_on(node, instance_id) == before + 1, f"{instance_id} did not serve the request"
            _delete(node, instance_id)
            live.remove(instance_id)
    finally:
        for instance_id in live:
            _delete(node, instance_id)


def _delete(node: LocalNode, instance_id: str) -> None:
    """Delete the instance and wait until the state no longer holds it (the next request must not be routed to
    it)."""
    with node.client() as client:
        assert client.delete(f"/instance/{instance_id}").status_code == 200

    def gone() -> bool:
        state = node.get("/state", timeout=10)
        return state is not None and instance_id not in state.get("instances", {})

    wait_until(lambda: gone() or None, 30, f"instance {instance_id} to leave the state")
