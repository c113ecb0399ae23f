"""The torch engine's native MoE families as Tensor over TWO real node processes (issue 40: "Tensor over 2 where
claimed"): each family's 16 greedy tokens, with their logprobs, are transformers' own forward's on the same prompt.

The torch engine claims Tensor for every family it runs natively (engine_choice.torch_splits), so each of these is
split head by head and expert by expert across two processes that each built only their half of every layer, with
an all_reduce inside every layer over the group wire:
- DeepSeek V3 (family_checkpoints'): MLA's heads split, its latent cached whole on both ranks; routed and shared
  experts split;
- GLM-4 MoE (test_glm4_moe's grouped variant: q/k norm and biases, expert groups, two shared experts);
- gpt-oss (test_gpt_oss's variant: attention sinks split with their heads, every bias drawn, clamped SwiGLU);
- Qwen3-MoE (family_checkpoints');
- Qwen3.5 MoE (test_qwen3_5's, the published multimodal layout): gated DeltaNet's heads split beside attention's.
The in-process and rank-process tests (test_deepseek_v3, test_glm4_moe, test_gpt_oss, test_qwen3_5's
*tensor_parallel*) hold the same sharding to one rank's logits; here it goes through placement, the runners and
their group. Seeded random float32 checkpoints from the local stand-in hub, two torch-only nodes started once for
the module, the families in turn (one instance at a time). Tokens must be equal, as test_mlx_families asks; each
family's top-two logprob gap is asserted at every step (transformers' own), so equality is not a coin toss."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skulk.testing.nodes import LocalNode
from tests.unit.test_glm4_moe import one_thread  # noqa: F401 - autouse: one torch thread for the references

from .harness import hub_and_nodes, instance_ready, place, wait_until
from .test_mlx_families import assert_same_tokens, greedy, reference

pytestmark = pytest.mark.timeout(180)

GAP = 0.01
"""transformers' top two logprobs differ by at least this at each step (checked when the reference is made): far
past the float32 noise of an all_reduce's different summation order (~1e-6)."""


def _deepseek_v3(root: Path, demo: Path) -> Path:
    from tests.unit.family_checkpoints import write

    return write("deepseek_v3", root, demo)


def _glm4_moe(root: Path, demo: Path) -> Path:
    from tests.unit.test_glm4_moe import _write_grouped

    return _write_grouped(root, demo)


def _gpt_oss(root: Path, demo: Path) -> Path:
    from tests.unit.test_gpt_oss import _write_variant

    return _write_variant(root, demo)


def _qwen3_moe(root: Path, demo: Path) -> Path:
    from tests.unit.family_checkpoints import write

    return write("qwen3_moe", root, demo)


def _qwen3_5_moe(root: Path, demo: Path) -> Path:
    from tests.unit.test_qwen3_5 import _write

    return _write(root, demo, moe=True)


WRITERS: dict[str, Callable[[Path, Path], Path]] = {
    "org/tp-deepseek-v3": _deepseek_v3, "org/tp-glm4-moe": _glm4_moe, "org/tp-gpt-oss": _gpt_oss,
    "org/tp-qwen3-moe": _qwen3_moe, "org/tp-qwen3.5-moe": _qwen3_5_moe,
}
"""Per model id: (scratch root, tokenizer donor) -> its checkpoint's directory, moved into the hub."""


def top_two_gaps(repo: Path) -> list[float]:
    """transformers' top-two logprob gap at each of the greedy steps test_mlx_families.reference takes."""
    import torch
    from transformers import AutoModelForCausalLM

    from skulk.engines.torch.tokenizer import ChatTokenizer
    from skulk.types.chat import ChatMessage

    from .test_mlx_families import MESSAGES, TOKENS

    ids = ChatTokenizer(repo).encode_chat([ChatMessage.model_validate(m) for m in MESSAGES])
    model = AutoModelForCausalLM.from_pretrained(str(repo), dtype=torch.float32).eval()
    gaps = []
    with torch.no_grad():
        for _ in range(TOKENS):
            top = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1).topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return gaps


@dataclass
class Served:
    nodes: list[LocalNode]
    expected: dict[str, list[tuple[str, float]]]
    gaps: dict[str, list[float]]


def _write_all(hub: Path, scratch: Path) -> tuple[dict[str, list[tuple[str, float]]], dict[str, list[float]]]:
    from tests.unit.family_checkpoints import tokenizer_donor

    demo = tokenizer_donor(scratch)
    expected, gaps = {}, {}
    for model_id, write in WRITERS.items():
        repo = hub / model_id.replace("/", "--")
        shutil.move(write(scratch / repo.name, demo), repo)
        expected[model_id], gaps[model_id] = reference(repo), top_two_gaps(repo)
    return expected, gaps


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Two formed torch-only nodes; the checkpoints are written while they start (the hub serves what its
    directory holds when asked, and nothing is asked before the first test adds a model)."""
    root = tmp_path_factory.mktemp("family-tensor")
    with hub_and_nodes(root, 2, _write_all, {"SKULK_ENGINES": "torch"}) as (nodes, (expected, gaps)):
        yield Served(nodes, expected, gaps)


@pytest.mark.parametrize("model_id", list(WRITERS), ids=[m.split("/")[1] for m in WRITERS])
def test_tensor_over_two_torch_nodes_gives_transformers_tokens(served: Served, model_id: str) -> None:
    """Placed as a torch Tensor instance over both nodes (every layer on both, each holding half its heads and
    experts); 16 greedy tokens with transformers' logprobs; then deleted, and the next family waits for its
    runners to be gone."""
    assert min(served.gaps[model_id]) >= GAP, f"a near tie in transformers' own tokens: {served.gaps[model_id]}"
    node = served.nodes[0]
    status, added = node.post("/models/add", {"model_id": model_id})
    assert status == 200 and added["torch_runtime"] == "native", added
    wait_until(lambda: not any(n.runner_pids() for n in served.nodes) or None, 60, "the earlier instance to stop")
    placed = place(node, model_id, min_nodes=2, sharding="Tensor", engine="torch")
    instance = next(iter(placed["instance"].values()))
    try:
        assert instance["engine"] == "torch", instance
        shards = instance["shardAssignments"]["runnerToShard"].values()
        assert [next(iter(s)) for s in shards] == ["TensorShardMetadata"] * 2, instance
        wait_until(lambda: instance_ready(node, placed["instanceId"]), 120, f"the {model_id} instance",
                   lambda: "".join(n.log_tail(20) for n in served.nodes))
        assert_same_tokens(greedy(node, model_id), served.expected[model_id])
    finally:
        with node.client() as client:
            assert client.delete(f"/instance/{placed['instanceId']}").status_code == 200
