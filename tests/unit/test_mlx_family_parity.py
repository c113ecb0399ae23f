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
from skulk.models.demo import generate_random_llama
from skulk.types.chat import SamplingParams
from skulk.types.instances import Sharding
from tests.unit.rank_jobs import launch
from tests.unit.test_mlx_engine import run, with_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # real model compute: `make test`, not `make test-fast`

TOKENS = 16
PROMPTS = [[1, 5, 9, 33, 2, 7, 100, 42, 11, 3] * 2, [72, 101, 108, 108, 111, 10]]
TIE = 1e-3
BOUND_S = 400
COMMON: dict[str, Any] = {"vocab_size": 260, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "max_position_embeddings": 512, "tie_word_embeddings": False, "initializer_range": 0.2}
"""initializer_range 0.2: peaked logits, so greedy's top two rarely tie."""
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1,
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "head_dim": 16, "partial_rotary_factor": 0.5}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "intermediate_size": 64, "num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {
        "intermediate_size": 64, "num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2,
        "head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_experts": 8,
        "num_experts_per_tok": 2, "head_dim": 16}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_hidden_layers": 4, "full_attention_interval": 4, "head_dim": 16, "linear_num_value_heads": 4,
        "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "intermediate_size": 128, "num_hidden_layers": 4, "hybrid_override_pattern": "M*M-", "mamba_num_heads": 4,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1, "head_dim": 16, "mamba_chunk_size": 16}),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", {
        "intermediate_size": 128, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8}),
}
"""Per family: transformers' config and model classes, and a small shape (heads and experts divisible by 2)."""
UNSPLIT = {"nemotron_h", "gemma4_text"}


def write(name: str, root: Path, demo: Path) -> Path:
    import torch
    import transformers

    config_cls, model_cls, shape = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**(COMMON | shape))
    model = getattr(transformers, model_cls)(config).float().eval()
    if name == "deepseek_v3":  # the router's correction bias spread, so experts are not picked by ties
        with torch.no_grad():
            for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if key.endswith("e_score_correction_bias"):
                    tensor.normal_(0, 0.1)
    model.save_pretrained(root / name)
    return with_tokenizer(root / name, demo)


def reference(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Per prompt ("r0", "r1"): transformers' greedy tokens and, at each, its top-two logprob gap."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    found: dict[str, tuple[list[int], list[float]]] = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ids, tokens, gaps = list(prompt), [], []
            for _ in range(TOKENS):
                top = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1).topk(2)
                tokens.append(int(top.indices[0]))
                gaps.append(float(top.values[0] - top.values[1]))
                ids.append(tokens[-1])
            found[f"r{i}"] = (tokens, gaps)
    return found


Reference = dict[str, tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Reference]]:
    root = tmp_path_factory.mktemp("mlx-families")
    demo = generate_random_llama(root / "demo", hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 intermediate_size=128, seed=3)
    made = {name: write(name, root, demo) for name in FAMILIES}
    return {name: (path, reference(path)) for name, path in made.items()}


def disagreement(got: dict[str, list[int]], expected: dict[str, tuple[list[int], list[float]]]) -> str | None:
    """None when every request's tokens are the reference's, or first diverge where the reference ties."""
    for rid, (theirs, gaps) in expected.items():
        mine = got.get(rid, [])
        if len(mine) != TOKENS:
            return f"{rid}: {len(mine)} tokens"
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        if at is not None and gaps[at] >= TIE:
            return f"{rid} diverges at token {at} ({mine[at]} vs {theirs[at]}), reference gap {gaps[at]:.4f}"
    return None


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
