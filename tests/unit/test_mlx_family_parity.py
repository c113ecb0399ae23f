"""The families people pool machines for, on the MLX engine, against transformers' own forward (the reference).

A seeded random checkpoint per family, as transformers 5 saves it (its config names: rope settings in
rope_parameters, num_local_experts; the MLX loader gives mlx-lm the published names, engines/mlx/engine.
published_fields): DeepSeek-V3 (MLA, dense then MoE), GLM-4 MoE, Mixtral, MiniMax-M2, Qwen3-MoE, Qwen3-Next (gated
DeltaNet beside attention), Nemotron-H (Mamba 2, attention and MLP layers) and Gemma 4. For each, two prompts'
16 greedy tokens from transformers (the whole sequence each step, float32) are the engine's on one MLX rank, and on
every split the card says mlx-lm has (models/families.MlxRegistry.splits): Pipeline over 2 ranks and Tensor over
2 (one 2-process ring steps through every family and layout). A first divergence is allowed only where the
reference's top two logprobs tie (within 1e-3). The families whose card offers no split (Nemotron-H, Gemma 4:
mixed layers in a plain stack, no shard()) are checked refused by placement's rule instead."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")  # the engine is absent (not broken) where MLX has no wheels

from skulk.master.engine_choice import mlx_splits
from skulk.models.catalog import card_from_config
from skulk.types.chat import SamplingParams
from skulk.types.instances import Sharding
from tests.unit.family_checkpoints import (
    FAMILIES,
    PROMPTS,
    TOKENS,
    UNSPLIT,
    Reference,
    disagreement,
    reference,
    tokenizer_donor,
    write,
)
from tests.unit.rank_jobs import launch
from tests.unit.test_mlx_engine import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # real model compute: `make test`, not `make test-fast`

BOUND_S = 400


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Reference]]:
    root = tmp_path_factory.mktemp("mlx-families")
    demo = tokenizer_donor(root)
    made = {name: write(name, root, demo) for name in FAMILIES}
    return {name: (path, reference(path)) for name, path in made.items()}


def test_one_mlx_rank_gives_transformers_tokens(families: dict[str, Any]) -> None:
    from skulk.engines.mlx.engine import MlxEngine

    wrong = {}
    for name, (path, expected) in families.items():
        outs = run(MlxEngine(path, prefill_chunk=8, max_seq=256), PROMPTS,
                   SamplingParams(max_tokens=TOKENS, temperature=0))
        if (why := disagreement({rid: [o.token_id for o in got] for rid, got in outs.items()}, expected)):
            wrong[name] = why
    assert not wrong, wrong


def splits(path: Path) -> list[str]:
    card = card_from_config(path.name, json.loads((path / "config.json").read_text()), 1)
    return [s.value for s in Sharding if mlx_splits(card, s, 2)]


def test_every_split_a_card_offers_gives_transformers_tokens(families: dict[str, Any], tmp_path: Path) -> None:
    """One 2-process ring runs each family on each split its card offers; the others are refused by placement."""
    from skulk.master.cycles import ring_hosts
    from skulk.testing.nodes import free_port
    from skulk.types.ids import NodeId

    offered = {name: splits(path) for name, (path, _) in families.items()}
    assert {n for n, s in offered.items() if not s} == UNSPLIT, offered
    assert offered["deepseek_v3"] == ["Pipeline", "Tensor"] and offered["qwen3_next"] == ["Pipeline"]

    def out(name: str, layout: str) -> str:
        return str(tmp_path / f"{name}.{layout}.json")

    def layers(path: Path, rank: int) -> list[int]:
        n = int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
        return [0, n // 2] if rank == 0 else [n // 2, n]

    runs: Callable[[int], list[dict[str, Any]]] = lambda rank: [  # noqa: E731
        {"model": str(path), "tensor": layout == "Tensor", "layers": None if layout == "Tensor" else layers(path, rank),
         "out": out(name, layout)}
        for name, (path, _) in families.items() for layout in offered[name]]
    hosts = ring_hosts([], [NodeId("n0"), NodeId("n1")], free_port())
    launch("mlx_rank.py", [{"rank": r, "hosts": hosts, "prompts": PROMPTS, "tokens": TOKENS, "model": "",
                            "runs": runs(r)} for r in range(2)], BOUND_S)
    wrong = {f"{name} {layout}": why for name, (_, expected) in families.items() for layout in offered[name]
             if (why := disagreement(json.loads(Path(out(name, layout)).read_text())["tokens"], expected))}
    assert not wrong, wrong
