"""The architecture numbers the torch model needs, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from skulk.models.layer_shapes import text_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6,
}
"""What transformers' Gemma3TextConfig fills in: hub configs of the multimodal `gemma3` checkpoints leave most
of their text_config to these defaults."""
_GEMMA3_ROPE_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
"""Gemma 3's rope bases when a hub-format config leaves them out (a transformers 5 config has rope_parameters)."""

SLIDING = "sliding_attention"


VISION_MODEL_TYPES = ("gemma3", "qwen2_5_vl")
"""Checkpoints whose vision tower the engine runs (vision.py: a `vision_config` beside the language model's)."""
BIDIRECTIONAL_IMAGE_TYPES = ("gemma3",)
"""Vision families whose image tokens attend to each other both ways within one image (Gemma 3); the rest (Qwen2.5-VL)
attend causally over them like any prompt."""


def is_vision_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") in VISION_MODEL_TYPES and bool(config.get("vision_config"))


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's own config: a multimodal `gemma3` checkpoint's text_config (its vision tower is not
    run), Gemma 3's defaults filled in; any other config as models/layer_shapes.text_of reads it (Llama 4's
    text_config, Nemotron-H's layer count)."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3":
        inner = dict(cfg.get("text_config") or {})
        for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
            if key in cfg and key not in inner:
                inner[key] = cfg[key]
        return _gemma3_defaults({**inner, "model_type": "gemma3_text"})
    if model_type == "gemma3_text":
        return _gemma3_defaults(cfg)
    inner = text_of(cfg)  # Llama 4: the decoder's numbers in text_config; Nemotron-H: its block list
    if model_type == "qwen3_5_moe":  # every layer a MoE: no dense width
        inner = {"intermediate_size": 0, **inner}
    if model_type in ("qwen2_5_vl", "qwen3_5", "qwen3_5_moe"):  # text_config says <type>_text: one name for both
        return {**inner, "model_type": model_type}
    return inner if inner is cfg or inner.get("model_type") else {**inner, "model_type": model_type}


def _gemma3_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = {} if cfg.get("rope_parameters") else _GEMMA3_ROPE_DEFAULTS
    return {**GEMMA3_TEXT_DEFAULTS, **rope, **cfg}


@dataclass(frozen=True, slots=True)
class MlaShape:
    """DeepSeek V3's multi-head latent attention (models/deepseek_v3.py): queries through a low-rank pair (or one
    q_proj when q_lora_rank is None), keys and values expanded per head from a kv_lora_rank latent, and a rope key
    of rope_dim shared by every head. scale: the softmax's, YaRN's mscale folded in."""

    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    interleaved: bool
    """The checkpoint's rope dimensions come in pairs (x0, x1), (x2, x3), ... (rope_interleave, the default)."""
    scale: float


@dataclass(frozen=True, slots=True)
class DeltaNetShape:
    """Qwen3-Next's linear-attention (gated DeltaNet) layers (models/qwen3_next.py): which layers they are, their
    key/value heads and widths, the causal conv's kernel, and the MoE's gated shared expert's width. Their past is
    a constant-size state per stream (conv window and recurrent matrix), not KV rows."""

    linear_layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    shared_expert_intermediate_size: int


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """One decoder architecture, as models.read_args reads it from a config (common_fields plus its family's
    own: the family files under models/). Qwen2 differs from Llama by qkv bias, Qwen3 by per-head q/k RMSNorm,
    Mistral by an optional sliding window; Gemma 3 and Qwen3-MoE add the fields after `dtype`."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    """Per layer, "sliding_attention" or "full_attention" (empty: all full). A sliding layer attends through
    sliding_window when it is set, and on Gemma rotates with rope_local_theta."""
    rope_local_theta: float | None = None
    """Gemma 3: the rope base of its sliding (local) layers, which take no rope scaling."""
    rope_freq_factors: tuple[float, ...] | None = None
    """Per rotary pair, the divisor of its frequency (global layers): a GGUF file's `rope_freqs` tensor, which is
    how llama.cpp's converter writes Llama 3 rope scaling (models/gguf_import.py copies it into config.json)."""
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    """The layers whose MLP is a sparse mixture of experts (Qwen3-MoE, GLM-4 MoE)."""
    n_shared_experts: int = 0
    """GLM-4 MoE: always-on experts of moe_intermediate_size each beside the routed ones (one MLP of their width)."""
    n_group: int = 1
    topk_group: int = 1
    """Grouped routing (moe.grouped_top_k): experts in n_group groups, only the topk_group best groups eligible."""
    routed_scaling_factor: float = 1.0
    rotary_dim: int | None = None
    """Partial rotary (GLM-4 MoE's partial_rotary_factor): rope turns the first rotary_dim of each head's
    dimensions; None: all head_dim."""
    mla: MlaShape | None = None
    """DeepSeek V3's attention; its cache holds one latent a position (num_key_value_heads 1, head_dim
    kv_lora_rank + qk_rope_head_dim wide, no separate values: models/deepseek_v3.py)."""
    delta_net: DeltaNetShape | None = None
    """Qwen3-Next's linear-attention layers and shared expert (None: no such layers)."""
    swiglu_limit: float = 0.0
    """gpt-oss's experts: the gate clamped above and the up projection both ways at this limit (0: no clamp)."""
    swiglu_alpha: float = 1.0
    """gpt-oss's experts: the gate's sigmoid gain (gate * sigmoid(alpha * gate))."""
    image_token_id: int | None = None
    """A vision-language checkpoint's image placeholder token (Gemma 3's <image_soft_token>): the positions whose
    input embedding is the vision tower's output."""
    images_bidirectional: bool = False
    """An image's tokens attend to each other both ways (Gemma 3: cache.StepBatch's mask, vision.image_mask)."""
    mrope_section: tuple[int, ...] | None = None
    """Multimodal rope (Qwen2.5-VL): the rotary pairs turned by the temporal, height and width position, in that
    order (mrope.py); None: one position turns every pair."""

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING


def common_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelArgs fields every family reads the same way, from a language model's own config (text_config):
    a family's file (models/) adds or overrides its own, and models.read_args puts the two together."""
    model_type = cfg["model_type"]
    # transformers 5 writes rope settings under rope_parameters; hub configs use rope_theta/rope_scaling.
    rope_params = _global_rope_parameters(cfg)
    scaling = cfg.get("rope_scaling") or rope_params or None
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    heads = cfg["num_attention_heads"]
    return {
        "model_type": model_type,
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "intermediate_size": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
        "rope_scaling": scaling,
        "rope_freq_factors": tuple(map(float, cfg["rope_freq_factors"])) if cfg.get("rope_freq_factors") else None,
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "qk_norm": False,
        "dtype": parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        **window_fields(cfg, model_type),
    }


def _global_rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters as transformers 5 writes them: flat, or per layer type (Gemma 3) with the global layers'
    under full_attention."""
    params = cfg.get("rope_parameters") or {}
    return params.get("full_attention", params) if isinstance(params, dict) else {}


def window_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Which layers attend through a sliding window: Mistral's every layer when its config sets one; Gemma 3's
    interleaved local layers (layer_types, or the older sliding_window_pattern: every n-th layer is global);
    gpt-oss's alternate ones (layer_types, else every even layer, as transformers' GptOssConfig fills them in).
    Qwen2/Qwen3 configs carry a window they do not use (use_sliding_window false): it is ignored."""
    window = cfg.get("sliding_window")
    n = cfg["num_hidden_layers"]
    if model_type == "mistral" and window:
        return {"sliding_window": int(window), "layer_types": (SLIDING,) * n}
    if model_type == "gpt_oss":
        types = cfg.get("layer_types") or [SLIDING if i % 2 == 0 else "full_attention" for i in range(n)]
        return {"sliding_window": int(window) if window else None, "layer_types": tuple(types)}
    if model_type != "gemma3_text":
        return {}
    types = cfg.get("layer_types")
    if not types:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)]
    # Gemma's local layers keep their own rope base even when a config turns the window off (null)
    return {"sliding_window": int(window) if window else None, "layer_types": tuple(types)}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a config string or a dtype; only the float types weights ship in."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
