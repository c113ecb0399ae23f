"""DeepSeek V3 on the torch engine's own layers (engines/torch/models/deepseek_v3.py: multi-head latent
attention, GLM-4 MoE's grouped experts), against transformers' modeling.

Two seeded random checkpoints in transformers 5's layout: family_checkpoints' (the one the MLX tests share:
q through its low-rank pair, interleaved rope, a dense first layer then experts with a shared one, two expert
groups of which one is eligible), and a variant that turns on what that one leaves off (one q_proj, the
half-split rope layout, YaRN with an mscale_all_dim folded into the softmax scale, values wider than keys,
q/kv biases drawn, unnormalised weights). Each one's 16 greedy tokens for two prompts are transformers' (its
forward over the whole sequence each step): on one rank through the engine (both prompts batched), and through
a two-stage pipeline; two tensor-parallel ranks give one rank's logits; bfloat16 stays near transformers'
bfloat16. The catalog then cards the family as native, with the cache the torch engine really keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.torch.layers import DecoderLayer
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.models.deepseek_v3 import MlaAttention
from skulk.engines.torch.moe import GroupedMoe
from skulk.master.shard_plan import group_bytes_per_token
from skulk.models.catalog import card_from_config
from skulk.models.demo import generate_random_llama
from skulk.models.memory_math import model_memory
from tests.unit.family_checkpoints import PROMPTS, disagreement, reference, with_tokenizer, write, write_model
from tests.unit.test_glm4_moe import (
    _engine_tokens,
    assert_bf16_near_transformers,
    assert_mixed_step_tokens,
    assert_tensor_ranks_match,
    assert_transformers_tokens,
    held_bytes,
    one_thread,  # noqa: F401 - the module's autouse fixture: one torch thread for tiny models
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real model compute: `make test`, not `make test-fast`

VARIANT: dict[str, Any] = {
    "q_lora_rank": None, "rope_interleave": False, "v_head_dim": 32, "attention_bias": True,
    "norm_topk_prob": False, "n_shared_experts": 2, "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                        "mscale_all_dim": 0.7, "original_max_position_embeddings": 512},
}
"""What the shared checkpoint leaves off (its config is transformers' defaults there)."""
IDS = torch.tensor([PROMPTS[0]])


def _write_variant(root: Path, demo: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The variant, its attention biases drawn (transformers starts them at zero, which would test nothing)."""
    from transformers import AutoModelForCausalLM

    base = write_model("deepseek_v3", root / f"variant_{str(dtype).removeprefix('torch.')}", **VARIANT)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("proj.bias") or name.endswith("proj_with_mqa.bias"):
                tensor.normal_(0, 0.1)
    (model.bfloat16() if dtype == torch.bfloat16 else model).save_pretrained(base)
    return with_tokenizer(base, demo)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek-v3")
    demo = generate_random_llama(root / "demo", hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 intermediate_size=128, seed=3)
    shared = write("deepseek_v3", root, demo)
    return {"shared": shared, "variant": _write_variant(root, demo),
            "variant_bf16": _write_variant(root, demo, torch.bfloat16), "kimi_k2": _as_kimi_k2(shared, root)}


def _as_kimi_k2(path: Path, root: Path) -> Path:
    """The shared checkpoint as Kimi K2 publishes its config: DeepSeek V3's architecture (architectures
    DeepseekV3ForCausalLM) under its own model_type, kimi_k2, which transformers does not know."""
    import json
    import shutil

    kimi = shutil.copytree(path, root / "kimi_k2")
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    return kimi


@pytest.mark.parametrize("name", ["shared", "variant"])
def test_greedy_tokens_are_transformers_on_one_rank_and_a_pipeline(name: str, checkpoints: dict[str, Path]) -> None:
    assert_transformers_tokens(checkpoints[name])


def test_kimi_k2_runs_natively_as_deepseek_v3(checkpoints: dict[str, Path]) -> None:
    """A kimi_k2-typed config loads through this family: its greedy tokens are transformers' DeepseekV3 ones for
    the same weights, and the catalog cards it native on torch, caching what the engine caches."""
    import json

    path = checkpoints["kimi_k2"]
    assert load_model(path).args.model_type == "kimi_k2"
    assert (why := disagreement(_engine_tokens(path), reference(checkpoints["shared"]))) is None, why
    config = json.loads((path / "config.json").read_text())
    card = card_from_config("moonshotai/kimi-tiny", config, (path / "model.safetensors").stat().st_size)
    assert card.torch_runtime == "native" and card.family == "kimi_k2"
    memory = model_memory(config)
    assert memory is not None
    layered = card.model_copy(update={"memory": memory})
    assert group_bytes_per_token(layered, 0, 3, engine="torch") == (load_model(path).kv_bytes_per_token(), 0)


def test_the_layers_are_the_configs(checkpoints: dict[str, Path]) -> None:
    """The variant: one q_proj, YaRN (its cos/sin scaled, the softmax scale with mscale_all_dim's factor squared),
    the cache as wide as the widest of key (16 + 8) and value (32), one cache head per query head; layer 0 dense,
    the rest grouped MoE with two shared experts."""
    model = load_model(checkpoints["variant"])
    args = model.args
    assert args.mla is not None and args.mla.q_lora_rank is None and not args.mla.interleaved
    assert args.head_dim == 32 and args.num_key_value_heads == 4 and args.rotary_dim == 8
    assert model.rope.attention_factor != 1.0 and args.mla.scale != pytest.approx(24**-0.5)
    dense, sparse = model.layers["0"], model.layers["1"]
    assert isinstance(dense, DecoderLayer) and isinstance(dense.self_attn, MlaAttention)
    assert not isinstance(dense.mlp, GroupedMoe)
    assert isinstance(sparse, DecoderLayer) and isinstance(sparse.mlp, GroupedMoe)
    assert sparse.mlp.shared_experts is not None and sparse.mlp.shared_experts.down_proj.weight.shape == (64, 64)
    assert hasattr(dense.self_attn, "q_proj") and not hasattr(dense.self_attn, "q_a_proj")


def test_tensor_parallel_ranks_give_one_ranks_logits(checkpoints: dict[str, Path]) -> None:
    """q_b_proj and kv_b_proj split by heads, o_proj by columns, the low-rank projections whole."""
    assert_tensor_ranks_match(checkpoints["shared"])


def test_bfloat16_stays_near_transformers(checkpoints: dict[str, Path]) -> None:
    """A bfloat16 checkpoint in bfloat16 on both sides: only rounding order differs (float32 matches above), each
    position's logits within 3% of transformers'; one position per prompt may have taken the other expert group
    on a near tie (test_glm4_moe's reasoning)."""
    assert_bf16_near_transformers(checkpoints["variant_bf16"])


def test_the_catalog_cards_deepseek_v3_as_native(checkpoints: dict[str, Path]) -> None:
    """Native now: its card says so, the per-layer weight arithmetic (models/memory_math.model_memory) is the
    bytes the engine holds, layer for layer, and placement's torch figure for a position's cache is the engine's
    own (expanded heads, not the latent MLX keeps)."""
    import json

    path = checkpoints["shared"]
    config = json.loads((path / "config.json").read_text())
    card = card_from_config("deepseek-ai/deepseek-tiny", config, (path / "model.safetensors").stat().st_size)
    assert card.torch_runtime == "native" and card.family == "deepseek_v3"
    memory = model_memory(config)
    assert memory is not None
    model = load_model(path)
    held = [held_bytes(layer) for layer in model.layers.values()]
    assert [layer.weight_bytes for layer in memory.layers] == held
    layered = card.model_copy(update={"memory": memory})  # a tiny file's headers are too much of it to card
    assert group_bytes_per_token(layered, 0, 3, engine="torch") == (model.kv_bytes_per_token(), 0)
    assert group_bytes_per_token(layered, 0, 3, engine="mlx") == (3 * (16 + 8) * 4, 0)  # the latent, float32


def test_a_prompt_joining_running_decodes_rides_a_mixed_step(checkpoints: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A second request arriving while the first decodes: its prefill shares steps with the decode row (a
    MixedBatch, each part attended on its own rows), and both still give transformers' tokens."""
    assert_mixed_step_tokens(checkpoints["shared"], MlaAttention, monkeypatch)
