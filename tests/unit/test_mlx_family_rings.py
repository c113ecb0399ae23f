"""Every family the torch engine runs, on several MLX ranks: the greedy tokens of one torch rank.

A random checkpoint per family (test_model_families' real configs, scaled down as the 1-rank parity test in
test_mlx_engine does, then given 6 heads and 3 kv heads so that Tensor over 3 splits both, and 3 layers so that Pipeline
over 3 has a layer per rank), float32, two requests batched (one prefilled in chunks across decode steps), 16 tokens
each, on Tensor over 3 and Pipeline over 3 MLX ranks (one 3-process ring that steps through every family and both
layouts) and a mixed torch+MLX Pipeline (one 2-process gloo group; Pipeline over 2 MLX ranks is test_mlx_family_parity's
and the MLX node tests'): exactly the torch engine's single-rank tokens, or the first divergence is a tie (the sampler's
top two logprobs within 1e-3: a Tensor ring sums its partial products in another order). One set of rank processes for
everything: start-up, not compute, is what a ring costs here."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")  # the engine is absent (not broken) where MLX has no wheels

from skulk.engines.torch.engine import TorchEngine
from skulk.master.engine_choice import mlx_splits
from skulk.models.catalog import card_from_config
from skulk.types.chat import SamplingParams
from skulk.types.instances import Sharding
from tests.unit.family_checkpoints import tokenizer_donor
from tests.unit.rank_jobs import launch
from tests.unit.test_mlx_engine import PROMPTS, run, tokens, with_tokenizer
from tests.unit.test_model_families import REAL_CONFIGS, scaled_down, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # real model compute: `make test`, not `make test-fast`

TOKENS = 16
RING_PROMPTS = PROMPTS[:2]
"""30 tokens (prefilled in chunks of 8 while the other decodes) and 3 tokens."""
LAYERS = 3
PIPELINE3 = [(0, 1), (1, 2), (2, 3)]
PIPELINE2 = [(0, 2), (2, 3)]
"""The mixed Pipeline's two stages."""
MIXED = ["torch", "mlx"]
"""The MLX rank last: its stage computes the family's final norm and head (tied or not), the torch rank samples."""
REFUSED = {"google/gemma-3-1b-it": "mlx-lm indexes Gemma 3's window layers by position (a Pipeline slice would "
                                   "mis-mask) and its model has no shard(): the engine refuses both splits"}
"""Families mlx-lm cannot split: the test asserts that engine_choice.mlx_splits refuses them."""
NOT_COMPARED = {"mistralai/Mistral-7B-v0.1": "mlx-lm builds the v0.1 sliding window as full attention, so even one "
                                             "MLX rank differs (test_mlx_engine's strict xfail says so)"}
FAMILIES = sorted(set(REAL_CONFIGS) - set(REFUSED) - set(NOT_COMPARED))
BOUND_S = 400
"""How long one rank process may take for every family (seconds on a quiet machine; minutes on a loaded one)."""


def ring_config(model_id: str) -> dict[str, Any]:
    """The family's scaled-down config with heads divisible by 3 (6 heads, 3 kv heads of 16), in float32."""
    config = scaled_down(model_id, REAL_CONFIGS[model_id], layers=LAYERS)
    config |= {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96, "intermediate_size": 192,
               "torch_dtype": "float32"}
    if "head_dim" in config:
        config["head_dim"] = 16
    if config["model_type"] == "qwen3_moe":  # experts' columns split over 3 ranks: 48 = 3 x 16
        config |= {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    return config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    demo = tokenizer_donor(root)
    return {m: with_tokenizer(write_checkpoint(ring_config(m), root / m.replace("/", "--")), demo) for m in FAMILIES}


def test_the_families_left_out_are_refused_or_known(checkpoints: dict[str, Path]) -> None:
    """The list of families not split is the engine's own: mlx_splits refuses both splits of each REFUSED one and
    allows every layout this test runs for the others."""
    for model_id in REFUSED:
        card = card_from_config(model_id, REAL_CONFIGS[model_id], 1)
        assert not mlx_splits(card, Sharding.Pipeline, 2) and not mlx_splits(card, Sharding.Tensor, 3), model_id
    for model_id in [*FAMILIES, *NOT_COMPARED]:
        card = card_from_config(model_id, ring_config(model_id), 1)
        assert mlx_splits(card, Sharding.Pipeline, 3) and mlx_splits(card, Sharding.Tensor, 3), model_id
    assert len(FAMILIES) + len(REFUSED) + len(NOT_COMPARED) == len(REAL_CONFIGS)


def test_every_family_on_several_ranks_gives_one_torch_ranks_tokens(checkpoints: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0)
    expected = {m: tokens(run(TorchEngine(path, prefill_chunk=8, max_seq=256), RING_PROMPTS, greedy))
                for m, path in checkpoints.items()}
    results = _run_every_layout(checkpoints, tmp_path)
    wrong = [f"{m} {layout}: {why}" for (m, layout), got in results.items()
             if (why := _disagreement(got, expected[m])) is not None]
    assert len(results) == 3 * len(FAMILIES)
    assert not wrong, "\n".join(wrong)


def _run_every_layout(checkpoints: dict[str, Path], tmp_path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The two groups of rank processes at once (each steps through every family): {(family, layout): what its
    sampler wrote}."""
    from skulk.master.cycles import ring_hosts
    from skulk.testing.nodes import free_port
    from skulk.types.ids import NodeId

    def out(model_id: str, layout: str) -> str:
        return str(tmp_path / f"{model_id.replace('/', '--')}.{layout}.json")

    common = {"prompts": RING_PROMPTS, "tokens": TOKENS, "model": ""}
    hosts3 = ring_hosts([], [NodeId(f"n{i}") for i in range(3)], free_port())
    ring3 = [{**common, "rank": r, "hosts": hosts3,
              "runs": [run for m, path in checkpoints.items() for run in (
                  {"model": str(path), "tensor": True, "layers": None, "out": out(m, "tensor3")},
                  {"model": str(path), "tensor": False, "layers": PIPELINE3[r], "out": out(m, "pipeline3")})]}
             for r in range(3)]
    port = free_port()
    mixed = [{**common, "rank": r, "port": port, "layers": PIPELINE2, "engines": MIXED, "runs": [
        {"model": str(path), "out": out(m, "mixed")} for m, path in checkpoints.items()]} for r in range(2)]
    errors: list[BaseException] = []

    def group(script: str, jobs: list[dict[str, Any]]) -> None:
        try:
            launch(script, jobs, BOUND_S)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=group, args=a) for a in (("mlx_rank.py", ring3), ("mixed_rank.py", mixed))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {(m, layout): json.loads(Path(out(m, layout)).read_text()) for m in checkpoints
            for layout in ("tensor3", "pipeline3", "mixed")}


def _disagreement(got: dict[str, Any], expected: dict[str, list[int]]) -> str | None:
    """None when the ranks' tokens are the torch rank's, or the first divergence is a tie in their own logprobs."""
    if set(got["tokens"]) != set(expected):
        return f"requests {sorted(got['tokens'])}, expected {sorted(expected)}"
    for rid, theirs in expected.items():
        mine = got["tokens"][rid]
        if len(theirs) != TOKENS or len(mine) != TOKENS:
            return f"{rid}: {len(mine)} tokens, torch {len(theirs)}"
        if mine != theirs:
            at = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
            if got["gaps"][rid][at] >= 1e-3:
                return f"{rid} diverges at token {at} ({mine[at]} vs {theirs[at]}), logprob gap {got['gaps'][rid][at]}"
    return None
