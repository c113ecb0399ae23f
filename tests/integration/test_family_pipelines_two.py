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
Each family's two instances are placed together and each serves one request, as test_family_pipelines'
over_three_and_two does (its helpers and reference are shared). A runner start costs ~8 CPU-s (torch and
transformers' modeling imported); that, not the tokens, is most of each test's time.

Seeded random float32 checkpoints (family_checkpoints' shapes) served by the local stand-in hub to three nodes
whose only engine is torch, started once for the module. Seeds are chosen so that at each of the 16 steps
transformers' top two logprobs differ by GAP (0.02) at least for this prompt (measured at seed 0: Mixtral's 0.007,
Qwen3-MoE's 0.020 and this Gemma 4's 0.001 were near-ties), and the fixture asserts it: equal tokens are then a
real check, far past float32 noise."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_glm4_moe import one_thread  # noqa: F401 - autouse: one torch thread for the references

from .test_family_pipelines import Served, Written, over_three_and_two, reference, serving

pytestmark = pytest.mark.timeout(240)

FAMILIES: dict[str, tuple[str, int]] = {
    "org/tiny-qwen3-moe": ("qwen3_moe", 2), "org/tiny-mixtral": ("mixtral", 2),
    "org/tiny-minimax-m2": ("minimax_m2", 0), "org/tiny-llama4": ("llama4_text", 0),
    "org/tiny-gemma4-moe": ("gemma4_moe", 3),
}
"""Per model id: its family_checkpoints name and seed (module docstring: why not always 0)."""
FALLBACK = {"org/tiny-mixtral", "org/tiny-minimax-m2", "org/tiny-llama4", "org/tiny-gemma4-moe"}


def layer_kinds(repo: Path) -> list[str]:
    """Each layer's kind where the family mixes them (its attention kind, and MoE or dense where only some layers
    route: Llama 4's moe_layers); one kind for all where it does not (Mixtral, MiniMax M2, Qwen3-MoE)."""
    config = json.loads((repo / "config.json").read_text())
    n = config["num_hidden_layers"]
    attention = config.get("layer_types") or ["attention"] * n
    moe = config.get("moe_layers")
    return [f"{a}/{'moe' if moe is None or i in moe else 'dense'}" for i, a in enumerate(attention)]


def _write_all(hub: Path, scratch: Path) -> Written:
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
    with serving(tmp_path_factory.mktemp("family-pipelines-two"), _write_all) as running:
        yield running


@pytest.mark.parametrize("model_id", list(FAMILIES), ids=[m.split("/")[1] for m in FAMILIES])
def test_a_pipeline_over_three_and_over_two_torch_nodes_gives_transformers_tokens(served: Served,
                                                                                   model_id: str) -> None:
    over_three_and_two(served, model_id, "transformers" if model_id in FALLBACK else "native")
