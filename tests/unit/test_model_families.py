"""Every architecture family the catalog lists, from its real config.json, against transformers.

Each config below is the one its Hugging Face repository ships (hub format: `rope_theta`/`rope_scaling`, the
real eps, tying, biases, head_dim and GQA ratio), with only the sizes scaled down so a random model of it is
small; the checkpoint is written in the hub's layout (safetensors, config.json) and read back by both our
loader and transformers. Weights are random: what is compared is the architecture, logit for logit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.loader import load_model
from skulk.models.catalog import card_from_config
from skulk.types.chat import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # runs real model compute: `make test`, not `make test-fast`

_LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": _LLAMA3_ROPE, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    "Qwen/Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 32768,
        "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064,
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    },
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    },
    "mistralai/Mistral-7B-Instruct-v0.3": {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 32768,
    },
    "mistralai/Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32000,
    },
    "google/gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144,
    },
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
}
HEADS = {"meta-llama": 8, "Qwen/Qwen2.5": 7, "Qwen/Qwen3-0.6B": 4, "Qwen/Qwen3-8B": 8, "mistralai": 8,
         "google/gemma-3": 4, "Qwen/Qwen3-30B-A3B": 16}
"""Attention heads after scaling, chosen so the real query/key-value ratio survives."""
WINDOW = 16
"""A sliding window shorter than the test prompts, for the families whose configs use one."""


def scaled_down(model_id: str, real: dict[str, Any], layers: int = 2, vocab: int = 512) -> dict[str, Any]:
    """The real config with heads, head_dim, widths, depth and vocabulary shrunk; ratios kept (GQA groups,
    hidden / (heads * head_dim), intermediate / hidden), everything else (rope, eps, tying, bias) untouched."""
    heads = next(v for k, v in HEADS.items() if model_id.startswith(k))
    shrink = real["num_attention_heads"] // heads
    head_dim = real.get("head_dim") or real["hidden_size"] // real["num_attention_heads"]
    new_head_dim = head_dim // 4
    hidden = real["hidden_size"] * heads * new_head_dim // (real["num_attention_heads"] * head_dim)
    config = {
        **real,
        "num_attention_heads": heads,
        "num_key_value_heads": real["num_key_value_heads"] // shrink,
        "hidden_size": hidden,
        "intermediate_size": real["intermediate_size"] * hidden // real["hidden_size"],
        "num_hidden_layers": layers,
        "vocab_size": vocab,
    }
    if "head_dim" in real:
        config["head_dim"] = new_head_dim
    if real["model_type"] == "gemma3_text":  # one global layer after five local ones: keep a whole period
        config["num_hidden_layers"] = max(layers, real["sliding_window_pattern"])
    if real["model_type"] in ("mistral", "gemma3_text") and real.get("sliding_window"):
        config["sliding_window"] = WINDOW
    if real["model_type"] == "qwen3_moe":  # 16 experts of 128 (whole int4 groups on each of 2 ranks), top 8
        config |= {"num_experts": 16, "moe_intermediate_size": 128}
    return config


def write_checkpoint(config: dict[str, Any], path: Path) -> Path:
    """A random model of config in the hub's layout; config.json is the hub-format dict itself (transformers
    would rewrite it in its own newer format, which hub repositories do not use)."""
    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():  # biases start at zero and norms at one: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("model_id", sorted(REAL_CONFIGS))
def test_family_logits_match_transformers(model_id: str, tmp_path: Path) -> None:
    config = scaled_down(model_id, REAL_CONFIGS[model_id])
    path = write_checkpoint(config, tmp_path / model_id.replace("/", "--"))
    tied = AutoConfig.for_model(**config).tie_word_embeddings  # Gemma's config leaves it to the default, True
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        assert ("lm_head.weight" in weights.keys()) is not tied  # noqa: SIM118 (safe_open is not a dict)

    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 42, 11, 3] * 10])  # 100 positions
    reference = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(ids).logits
    model = load_model(path, dtype=torch.float32)
    with torch.inference_mode():
        got = model(ids, StepBatch.build(torch.arange(ids.shape[1]).unsqueeze(0), 0), model.make_cache(1, 128))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    card = card_from_config(model_id, REAL_CONFIGS[model_id], 1)
    assert card.family == config["model_type"] and card.n_layers == REAL_CONFIGS[model_id]["num_hidden_layers"]


def test_a_real_config_loads_in_its_own_dtype_and_generates(tmp_path: Path) -> None:
    """As shipped, bfloat16: the engine runs it in that dtype and greedy decoding is deterministic."""
    config = scaled_down("Qwen/Qwen3-0.6B", REAL_CONFIGS["Qwen/Qwen3-0.6B"])
    path = write_checkpoint(config, tmp_path / "qwen3")
    engine = TorchEngine(path, max_batch=2, max_seq=64)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    greedy = SamplingParams(max_tokens=6, temperature=0)
    runs = []
    for rid in ("a", "b"):
        engine.add_request(rid, [1, 5, 9, 33], greedy)
        tokens = []
        while engine.has_work():
            tokens += [t.token_id for t in engine.step()]
        runs.append(tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 6
