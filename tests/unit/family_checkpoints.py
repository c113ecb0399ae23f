"""Seeded random checkpoints of the families people pool machines for, in transformers 5's own layout, and
transformers' greedy tokens for them (the reference every engine that claims a family is held to).

Shared by the MLX parity test (test_mlx_family_parity.py) and the torch engine's transformers fallback
(test_fallback_families.py). Each family's shape is small (heads and experts divisible by 2) and its tokenizer
the demo's byte tokenizer with no end-of-sequence token, so every request runs its full TOKENS."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENS = 16
PROMPTS = [[1, 5, 9, 33, 2, 7, 100, 42, 11, 3] * 2, [72, 101, 108, 108, 111, 10]]
TIE = 1e-3
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
MORE: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "intermediate_size": 64, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
        "head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", {
        "intermediate_size": 64, "intermediate_size_mlp": 128, "num_hidden_layers": 4, "num_local_experts": 4,
        "num_experts_per_tok": 1, "head_dim": 16, "interleave_moe_layer_step": 2, "no_rope_layers": [1, 1, 1, 0],
        "attention_chunk_size": 8}),
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", {
        "intermediate_size": 64, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 0,
        "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
        "attention_k_eq_v": True, "global_head_dim": 32, "num_global_key_value_heads": 2,
        "final_logit_softcapping": 30.0}),
}
"""Families checked on the torch engine's transformers fallback only (test_fallback_families.py). gemma4_moe is
Gemma 4 as the cluster-sized 26B-A4B is shaped (31B the same without its MoE block): no per-layer inputs and no
layers sharing another's keys and values, so its layers take only hidden states and it splits
(families.fallback_splits); sliding and full layers, the full ones with their own wider head and keys as values
(attention_k_eq_v), a dense MLP and a routed MoE block side by side in every layer, soft-capped logits. FAMILIES'
gemma4_text is the E2B/E4B kind, whose per-layer inputs keep it on one rank."""


def write(name: str, root: Path, demo: Path) -> Path:
    return with_tokenizer(write_model(name, root), demo)


def write_model(name: str, root: Path, seed: int = 0, **overrides: Any) -> Path:
    """The family's seeded random checkpoint (config and safetensors, no tokenizer) in root/name; overrides change
    its config (a seed other than 0 where a test's own prompt would meet a near-tie at seed 0)."""
    import torch
    import transformers

    config_cls, model_cls, shape = (FAMILIES | MORE)[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**(COMMON | shape | overrides))
    model = getattr(transformers, model_cls)(config).float().eval()
    if name == "deepseek_v3":  # the router's correction bias spread, so experts are not picked by ties
        with torch.no_grad():
            for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if key.endswith("e_score_correction_bias"):
                    tensor.normal_(0, 0.1)
    model.save_pretrained(root / name)
    return root / name


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


def tokenizer_donor(root: Path) -> Path:
    """The tiny Llama under root/demo whose byte tokenizer the family checkpoints borrow (with_tokenizer)."""
    from skulk.models.demo import generate_random_llama

    return generate_random_llama(root / "demo", hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 intermediate_size=128, seed=3)


def save_drawn(model: Any, root: Path, name: str, dtype: Any, demo: Path) -> Path:
    """A family model whose weights a test drew itself, saved in its Hugging Face layout as `name_<dtype>` (in
    bfloat16 when asked) with the donor's tokenizer."""
    import torch

    path = root / f"{name}_{str(dtype).removeprefix('torch.')}"
    (model.bfloat16() if dtype == torch.bfloat16 else model).save_pretrained(path)
    return with_tokenizer(path, demo)


def with_tokenizer(path: Path, demo: Path) -> Path:
    """A random family checkpoint gets the demo's byte tokenizer (its vocabulary fits every scaled-down one), with
    no end-of-sequence token: random weights would otherwise end some requests early."""
    shutil.copy(demo / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((demo / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


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
