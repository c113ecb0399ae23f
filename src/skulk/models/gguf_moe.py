"""A GGUF file of a family whose GGUF layout the torch engine does not read (llama.cpp's `deepseek2`, `glm4moe`,
`gpt-oss`, `qwen3next`, `qwen35moe`, `qwen35`), turned into the Hugging Face checkpoint those families run from:
the torch engine's native DeepSeek V3, GLM-4 MoE, gpt-oss, Qwen3-Next and Qwen3.5 files, the transformers fallback
(engines/torch/fallback.py) and mlx-lm all read only float safetensors in the hub's layout.

transformers' GGUF support knows none of these architectures, so config.json is built here from the file's metadata
(the keys llama.cpp's convert_hf_to_gguf writes for them), and every tensor is dequantized by the `gguf` package and
written under its Hugging Face name: the stacked experts (`ffn_*_exps`) unstacked into the hub's
`mlp.experts.<e>.*_proj`, the shared experts (`*_shexp`) as `mlp.shared_experts`, the router's correction bias
(`exp_probs_b`) as `e_score_correction_bias`, and DeepSeek's MLA projections under their own names, with the
`attn_k_b`/`attn_v_b` pair newer converters split `kv_b_proj` into joined back; gpt-oss's gate and up rows
interleaved back into `gate_up_proj`; Qwen3-Next's linear attention (`attn_qkv` + `attn_gate` regrouped into
`in_proj_qkvz`, `ssm_a` back to `A_log`) and its norms less the 1 llama.cpp adds. Qwen3.5 is converted as
Qwen3-Next, its four input projections kept apart and its value heads reordered (llama.cpp's
_LinearAttentionVReorderBase): they are put back in the hub's order, and written in the published multimodal
layout (text_config, model.language_model., the experts stacked) that the torch engine and mlx-lm read.
Quantized tensors come out in bfloat16, float ones in their own dtype (so an F32 file's checkpoint is exact).
llama.cpp permutes no other rows of these families (their rope is already the layout it computes), and the
multi-token-prediction layers a GLM file carries past its last layer (`nextn`) are dropped, as transformers drops
them; any other tensor in a layer without a hub name here refuses the file rather than leave a weight at random.
The checkpoint is what the card counts: a 4-bit file grows about 3.5x.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

DEQUANTIZED_ARCHS = ("deepseek2", "glm4moe", "gpt-oss", "qwen3next", "qwen35moe", "qwen35")
"""llama.cpp architectures imported as a dequantized Hugging Face checkpoint (the rest run from the file)."""
TORCH_ONLY_ARCHS = ("gpt-oss",)
"""Architectures whose checkpoint mlx-lm cannot read: its gpt-oss reads the hub's MXFP4 experts (or its own
split), not transformers' float gate_up_proj [experts, hidden, 2 x width]; the card offers only torch."""
_FLOATS = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.(weight|bias))?$")
"""A layer's tensor: its layer, llama.cpp's name, and weight or bias (none for some, e.g. Qwen3-Next's ssm_a)."""
_COMMON = {
    "attn_norm": "input_layernorm", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_IN_LAYER = {
    "deepseek2": {**_COMMON, "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                  "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj"},
    "glm4moe": {**_COMMON, "post_attention_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm"},
    "gpt-oss": {**_COMMON, "post_attention_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "ffn_gate_inp": "mlp.router"},
    "qwen3next": {**_COMMON, "post_attention_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                  "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_q_norm": "self_attn.q_norm",
                  "attn_k_norm": "self_attn.k_norm", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                  "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                  "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ssm_ba": "linear_attn.in_proj_ba",
                  "ssm_out": "linear_attn.out_proj", "ssm_norm": "linear_attn.norm"},
}
_QWEN3_5 = {**{k: v for k, v in _IN_LAYER["qwen3next"].items() if k != "ssm_ba"},
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
            "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
            "attn_gate": "linear_attn.in_proj_z"}
_IN_LAYER |= {"qwen35moe": _QWEN3_5, "qwen35": _QWEN3_5}
QWEN3_5_ARCHS = ("qwen35moe", "qwen35")
"""Qwen3.5 (Qwen3_5TextModel -> qwen35, Qwen3_5MoeTextModel -> qwen35moe): Qwen3-Next's conversion with the
linear attention's four input projections kept apart and its value heads reordered (_QWEN3_5_V)."""
_PLUS_ONE_NORMS = {"attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm"}
"""Qwen3-Next's and Qwen3.5's zero-centred norms, which llama.cpp stores as weight + 1 (all but the linear
attention's)."""
_QWEN3_5_V = {"attn_gate": (0, "v"), "ssm_beta": (0, 1), "ssm_alpha": (0, 1), "ssm_a": (0, 1), "ssm_dt": (0, 1),
              "ssm_out": (1, "v")}
"""The tensors whose value heads llama.cpp's _LinearAttentionVReorderBase reorders (besides attn_qkv's and the
conv's v channels): the axis, and each head's width (1, or "v" for linear_value_head_dim)."""
_QWEN3_5_OWN = {*_QWEN3_5_V, "attn_qkv", "ssm_conv1d", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                "ffn_gate_up_exps"}
"""The Qwen3.5 tensors _qwen3_5_tensors turns back: reordered value heads, and the experts kept stacked."""
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_SIGMOID = 2
"""llama.cpp's expert_gating_func for sigmoid routing (1 is softmax)."""


class UnreadableMetadata(ValueError):
    """The file lacks a metadata key its architecture needs (or holds one we cannot turn into a config)."""


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """The file's scalar and short-array metadata (the tokenizer's long arrays left out)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("tokenizer.ggml.") and not key.startswith("GGUF.")}


def hf_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json (the hub's keys, which transformers and mlx-lm both read) for a file of DEQUANTIZED_ARCHS;
    tensors are read_layout's (llama.cpp name -> [block type, row-major shape, offset])."""
    arch = str(meta["general.architecture"])

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise UnreadableMetadata(f"the GGUF file has no {arch}.{key}")
        return value

    config = _common(get, meta, tensors)
    if arch == "gpt-oss":
        return config | _gpt_oss(get)
    if arch == "qwen3next":
        return config | _qwen3next(get)
    if arch in QWEN3_5_ARCHS:
        return _qwen3_5(get, config, arch == "qwen35moe")
    return config | _sigmoid_router(get) | (_deepseek2(get) if arch == "deepseek2" else _glm4moe(get, tensors))


def _common(get: Callable[..., Any], meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """What every family's config says alike: sizes, norms, rope, the ends of the vocabulary; the dtype the
    embedding is written in (a float file's own, else bfloat16)."""
    embedding = tensors["token_embd.weight"]
    dtype = {QT.F32: "float32", QT.F16: "float16"}.get(QT(embedding[0]), "bfloat16")
    config: dict[str, Any] = {
        "vocab_size": int(embedding[1][0]), "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length", 0)),  # none in a file of only experts (qwen35moe)
        "num_attention_heads": int(get("attention.head_count")), "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)), "hidden_act": "silu", "attention_dropout": 0.0,
        "tie_word_embeddings": "output.weight" not in tensors, "torch_dtype": dtype,
        "num_experts_per_tok": int(get("expert_used_count", 0)), "rope_scaling": _rope_scaling(get),
    }
    for name in ("bos", "eos"):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            config[f"{name}_token_id"] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    return config


def _sigmoid_router(get: Callable[..., Any]) -> dict[str, Any]:
    """DeepSeek V3's router, which GLM-4 MoE shares: routed and shared experts, dense leading layers, grouped
    sigmoid top-k with a correction bias."""
    return {"moe_intermediate_size": int(get("expert_feed_forward_length")),
            "n_routed_experts": int(get("expert_count")), "n_shared_experts": int(get("expert_shared_count", 0)),
            "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(get("expert_weights_norm", False)), "n_group": int(get("expert_group_count", 1)),
            "topk_group": int(get("expert_group_used_count", 1)), "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def _gpt_oss(get: Callable[..., Any]) -> dict[str, Any]:
    """gpt-oss's config: every layer MoE (intermediate_size is the experts' width), sliding and full attention
    alternating from a sliding first layer (llama.cpp's swa pattern 2), biases everywhere, attention sinks, and
    the clamped SwiGLU (limit 7, alpha 1.702) llama.cpp hard-codes for it; its YaRN does not truncate."""
    layers = int(get("block_count"))
    scaling = _rope_scaling(get)
    if scaling is not None:
        scaling["truncate"] = False
    return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": layers,
            "intermediate_size": int(get("expert_feed_forward_length")), "num_local_experts": int(get("expert_count")),
            "num_key_value_heads": int(get("attention.head_count_kv")), "head_dim": int(get("attention.key_length")),
            "sliding_window": int(get("attention.sliding_window")), "attention_bias": True,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "swiglu_limit": 7.0, "rope_scaling": scaling}


def _qwen3next(get: Callable[..., Any]) -> dict[str, Any]:
    """Qwen3-Next's config: gated DeltaNet layers with a full-attention layer every full_attention_interval
    (the last of each run), their widths from llama.cpp's ssm keys, every layer MoE with one gated shared expert."""
    layers, interval = int(get("block_count")), int(get("full_attention_interval", 4))
    head_dim, value_heads = int(get("attention.key_length")), int(get("ssm.time_step_rank"))
    return {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": layers,
            "num_key_value_heads": int(get("attention.head_count_kv")), "head_dim": head_dim,
            "partial_rotary_factor": int(get("rope.dimension_count")) / head_dim,
            "num_experts": int(get("expert_count")), "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length")),
            "norm_topk_prob": bool(get("expert_weights_norm", True)), "decoder_sparse_step": 1,
            "mlp_only_layers": [], "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
            "linear_key_head_dim": int(get("ssm.state_size")), "linear_num_key_heads": int(get("ssm.group_count")),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads, "full_attention_interval": interval,
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(layers)],
            "mtp_num_hidden_layers": 0}  # the import writes no mtp. block (layer_shapes.mtp_tensors counts one)


def _qwen3_5(get: Callable[..., Any], common: dict[str, Any], moe: bool) -> dict[str, Any]:
    """Qwen3.5's config in the published multimodal layout the torch engine runs natively and mlx-lm's qwen3_5_moe
    / qwen3_5 read (Qwen3_5MoeForConditionalGeneration: the language model's keys under text_config, no vision
    tower): Qwen3-Next's sizes, the keys Qwen3_5(Moe)TextConfig declares, rope under rope_parameters with the
    file's rope.dimension_sections as mrope_section (llama.cpp's interleaved M-RoPE; [11, 11, 10] its default)."""
    next_keys = _qwen3next(get if moe else _no_experts(get))
    sections = [int(s) for s in get("rope.dimension_sections", [11, 11, 10, 0])][:3]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": common["rope_theta"],
                            "partial_rotary_factor": next_keys["partial_rotary_factor"], "mrope_section": sections,
                            "mrope_interleaved": True}
    if common["rope_scaling"] is not None:
        rope |= {k: v for k, v in common["rope_scaling"].items() if k != "type"}
    text = {k: common[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "max_position_embeddings",
                                   "rms_norm_eps", "hidden_act", "attention_dropout", "tie_word_embeddings",
                                   "torch_dtype", "bos_token_id", "eos_token_id") if k in common}
    text |= {k: next_keys[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim", "layer_types",
                                       "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
                                       "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim")}
    if moe:
        text |= {k: next_keys[k] for k in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")}
        text["num_experts_per_tok"] = common["num_experts_per_tok"]
    else:
        text["intermediate_size"] = common["intermediate_size"]
    name = "qwen3_5_moe" if moe else "qwen3_5"
    return {"model_type": name, "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                                                  else "Qwen3_5ForConditionalGeneration"],
            "text_config": {**text, "model_type": f"{name}_text", "attention_bias": False, "rope_parameters": rope},
            "tie_word_embeddings": common["tie_word_embeddings"], "torch_dtype": common["torch_dtype"]}


def _no_experts(get: Callable[..., Any]) -> Callable[..., Any]:
    """get, with the expert keys Qwen3-Next's config reads answered 0 (the dense qwen35 has none)."""
    def dense(key: str, default: Any = None) -> Any:
        return 0 if key.startswith("expert_") else get(key, default)
    return dense


def _rope_scaling(get: Callable[..., Any]) -> dict[str, Any] | None:
    """llama.cpp's YaRN keys as the hub's rope_scaling (DeepSeek V3's: factor 40 over 4,096 positions);
    its yarn_log_multiplier is 0.1 x mscale_all_dim (convert_hf_to_gguf)."""
    kind = get("rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind != "yarn":
        raise UnreadableMetadata(f"rope scaling {kind!r} has no Hugging Face form here")
    scaling: dict[str, Any] = {"type": "yarn", "rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                               "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                               "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
    mscale = round(float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)  # stored as f32
    if mscale:
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
    return scaling


def _deepseek2(get: Callable[..., Any]) -> dict[str, Any]:
    """DeepSeek V3's config (and Kimi K2's, GLM-4.7-Flash's: the same modeling). llama.cpp writes MLA as one
    shared KV head of kv_lora_rank + rope width, with the per-head widths under `*_length_mla`; older files
    wrote the per-head widths as key_length/value_length themselves."""
    if int(get("expert_gating_func", 1)) != _SIGMOID:
        raise UnreadableMetadata("a deepseek2 file with softmax routing (DeepSeek V2) has no import here yet; "
                                 "DeepSeek V3's sigmoid routing does")
    heads = int(get("attention.head_count"))
    rope = int(get("rope.dimension_count"))
    key = int(get("attention.key_length_mla", 0) or get("attention.key_length"))
    value = int(get("attention.value_length_mla", 0) or get("attention.value_length"))
    q_lora = get("attention.q_lora_rank", 0)
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
            "num_hidden_layers": int(get("block_count")), "num_key_value_heads": heads,
            "kv_lora_rank": int(get("attention.kv_lora_rank")), "q_lora_rank": int(q_lora) or None,
            "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "v_head_dim": value, "head_dim": rope,
            "rope_interleave": True, "num_nextn_predict_layers": 0, "attention_bias": False}


def _glm4moe(get: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5/4.6's config: block_count counts the multi-token-prediction layers past the last decoder layer."""
    head_dim = int(get("attention.key_length"))
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
            "num_hidden_layers": int(get("block_count")) - int(get("nextn_predict_layers", 0)),
            "num_key_value_heads": int(get("attention.head_count_kv")), "head_dim": head_dim,
            "partial_rotary_factor": int(get("rope.dimension_count")) / head_dim,
            "attention_bias": "blk.0.attn_q.bias" in tensors, "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
            "num_nextn_predict_layers": 0}


def hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the family's modeling loads, under its hub name, one at a time (a stacked expert tensor one
    expert at a time, except gpt-oss's, which the hub keeps stacked), dequantized: quantized ones to bfloat16,
    float ones in their own dtype."""
    arch = str(reader.get_field("general.architecture").contents())  # type: ignore[union-attr]
    table = _IN_LAYER[arch]
    text = config.get("text_config", config)
    inner_model = "model.language_model" if arch in QWEN3_5_ARCHS else "model"  # the published Qwen3.5 layout
    pending: dict[str, torch.Tensor] = {}  # a layer's halves of one hub tensor, until both are read
    for tensor in reader.tensors:
        if tensor.name in _TOP:
            yield (_TOP[tensor.name].replace("model.", f"{inner_model}.", 1),
                   _unbiased(arch, tensor.name.partition(".")[0], tensor))
            continue
        match = _LAYER.match(tensor.name)
        if match is None or int(match.group(1)) >= text["num_hidden_layers"]:
            continue  # rope tables, and the multi-token-prediction layers past the last one
        layer, inner, part = match.groups()
        prefix = f"{inner_model}.layers.{layer}"
        if arch in QWEN3_5_ARCHS and inner in _QWEN3_5_OWN:
            yield from ((f"{prefix}.{name}", values) for name, values in _qwen3_5_tensors(inner, part, tensor,
                                                                                          pending, text))
        elif arch == "gpt-oss" and (inner in _EXPERTS or inner == "attn_sinks"):
            pending[f"{inner}.{part}"] = _values(tensor.data, tensor.tensor_type)
            yield from ((f"{prefix}.{name}", values) for name, values in _gpt_oss_joined(pending))
        elif inner in _EXPERTS:
            for expert in range(tensor.data.shape[0]):
                yield (f"{prefix}.mlp.experts.{expert}.{_EXPERTS[inner]}.weight",
                       _values(tensor.data[expert], tensor.tensor_type))
        elif inner == "exp_probs_b":
            yield f"{prefix}.mlp.gate.e_score_correction_bias", _values(tensor.data, tensor.tensor_type)
        elif inner in ("attn_k_b", "attn_v_b"):
            pending[inner] = _values(tensor.data, tensor.tensor_type)
            if len(pending) == 2:
                yield f"{prefix}.self_attn.kv_b_proj.weight", _kv_b(pending.pop("attn_k_b"), pending.pop("attn_v_b"))
        elif arch == "qwen3next" and inner in ("ssm_a", "ssm_dt", "ssm_conv1d", "attn_qkv", "attn_gate"):
            pending[inner] = _values(tensor.data, tensor.tensor_type)
            yield from ((f"{prefix}.{name}", values) for name, values in _qwen3next_joined(pending, config))
        elif inner in table and part is not None:
            yield f"{prefix}.{table[inner]}.{part}", _unbiased(arch, inner, tensor)
        else:  # a tensor the family's modeling would otherwise leave at random
            raise UnreadableMetadata(f"tensor {tensor.name} has no Hugging Face name for {arch} here")


def _unbiased(arch: str, inner: str, tensor: Any) -> torch.Tensor:
    """The tensor's values, Qwen3-Next's zero-centred norms without the 1 llama.cpp adds."""
    values = _values(tensor.data, tensor.tensor_type)
    return values - 1 if arch in ("qwen3next", *QWEN3_5_ARCHS) and inner in _PLUS_ONE_NORMS else values


def _qwen3next_joined(pending: dict[str, torch.Tensor], config: dict[str, Any]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's linear attention as the hub has it, from Qwen3NextModel's conversion undone: A_log from
    ssm_a = -exp(A_log), dt_bias, the conv kernel's channel axis back, and in_proj_qkvz from attn_qkv (all q
    heads, all k, all v) and attn_gate (z): the hub interleaves them per key head ([q, k, v, z] per head)."""
    if "ssm_a" in pending:
        yield "linear_attn.A_log", torch.log(-pending.pop("ssm_a").float()).to(torch.float32)
    if "ssm_dt" in pending:
        yield "linear_attn.dt_bias", pending.pop("ssm_dt")
    if "ssm_conv1d" in pending:
        yield "linear_attn.conv1d.weight", pending.pop("ssm_conv1d").unsqueeze(1).contiguous()
    if "attn_qkv" in pending and "attn_gate" in pending:
        qkv, z = pending.pop("attn_qkv"), pending.pop("attn_gate")
        heads, key_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
        q, k, v = qkv.split([heads * key_dim, heads * key_dim, qkv.shape[0] - 2 * heads * key_dim])
        per_head = [t.reshape(heads, -1, t.shape[-1]) for t in (q, k, v, z)]
        yield "linear_attn.in_proj_qkvz.weight", torch.cat(per_head, dim=1).reshape(-1, qkv.shape[-1]).contiguous()


def _qwen3_5_tensors(inner: str, part: str | None, tensor: Any, pending: dict[str, torch.Tensor],
                     text: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Qwen3.5's tensors that llama.cpp reordered or stacked, as the hub has them: each value-head tensor back
    from llama.cpp's tiled order (_grouped_heads), A_log from ssm_a = -exp(A_log), the conv kernel's channel axis
    back; the experts stacked as the published checkpoint keeps them (mlx-lm's qwen3_5_moe reads only that):
    gate_up_proj [experts, 2 x width, hidden] (gate rows, then up rows) and down_proj [experts, hidden, width]."""
    values = _values(tensor.data, tensor.tensor_type)
    keys, heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    key_dim, value_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
    if inner in ("attn_qkv", "ssm_conv1d"):  # rows/channels: every q head, every k head, then the v heads
        qk, v = values.split([2 * keys * key_dim, heads * value_dim])
        values = torch.cat([qk, _grouped_heads(v, 0, keys, heads, value_dim)]).contiguous()
        if inner == "ssm_conv1d":
            return [("linear_attn.conv1d.weight", values.unsqueeze(1).contiguous())]
        return [("linear_attn.in_proj_qkv.weight", values)]
    if inner in _QWEN3_5_V:
        dim, width = _QWEN3_5_V[inner]
        values = _grouped_heads(values, dim, keys, heads, value_dim if width == "v" else 1)
        if inner == "ssm_a":
            return [("linear_attn.A_log", torch.log(-values.float()).to(torch.float32))]
        if inner == "ssm_dt":
            return [("linear_attn.dt_bias", values)]
        return [(f"{_QWEN3_5[inner]}.{part}", values)]
    pending[inner] = values
    out = []
    if "ffn_down_exps" in pending:
        out.append(("mlp.experts.down_proj", pending.pop("ffn_down_exps")))
    if "ffn_gate_up_exps" in pending:  # llama.cpp's fused form of the same rows
        out.append(("mlp.experts.gate_up_proj", pending.pop("ffn_gate_up_exps")))
    if "ffn_gate_exps" in pending and "ffn_up_exps" in pending:
        gate_up = torch.cat([pending.pop("ffn_gate_exps"), pending.pop("ffn_up_exps")], dim=1)
        out.append(("mlp.experts.gate_up_proj", gate_up.contiguous()))
    return out


def _grouped_heads(values: torch.Tensor, dim: int, keys: int, heads: int, width: int) -> torch.Tensor:
    """Value heads back in the hub's order, grouped by key head (k0's v0 .. v(r-1), then k1's ...), from the
    tiled order llama.cpp's _reorder_v_heads writes (v0 of every key head, then v1 of every one, ...): the axis
    seen as [r, keys, width], its first two swapped. Nothing moves where there are as many key heads as value
    heads."""
    per_key = heads // keys
    if per_key == 1:
        return values
    shape = values.shape
    tiled = values.reshape(*shape[:dim], per_key, keys, width, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape).contiguous()


def _gpt_oss_joined(pending: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's hub tensors from what llama.cpp split (convert_hf_to_gguf's GptOssModel, undone): gate_up_proj
    [experts, hidden, 2 x width] with gate and up interleaved column by column, down_proj [experts, width,
    hidden] (both transposed back), their biases, and the sinks (llama.cpp adds `.weight`)."""
    if "attn_sinks.weight" in pending:
        yield "self_attn.sinks", pending.pop("attn_sinks.weight")
    if "ffn_down_exps.weight" in pending:
        yield "mlp.experts.down_proj", pending.pop("ffn_down_exps.weight").transpose(1, 2).contiguous()
    if "ffn_down_exps.bias" in pending:
        yield "mlp.experts.down_proj_bias", pending.pop("ffn_down_exps.bias")
    for part, name in (("weight", "mlp.experts.gate_up_proj"), ("bias", "mlp.experts.gate_up_proj_bias")):
        gate, up = pending.get(f"ffn_gate_exps.{part}"), pending.get(f"ffn_up_exps.{part}")
        if gate is None or up is None:
            continue
        del pending[f"ffn_gate_exps.{part}"], pending[f"ffn_up_exps.{part}"]
        joined = torch.stack([gate, up], dim=2).flatten(1, 2)  # rows gate0, up0, gate1, up1, ...
        yield name, (joined.transpose(1, 2) if part == "weight" else joined).contiguous()


def _kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj from llama.cpp's split: k_b is [heads, kv_lora, nope] (transposed), v_b [heads, v, kv_lora];
    the hub's rows are each head's nope rows then its v rows."""
    joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return joined.reshape(-1, joined.shape[-1]).contiguous()


def _values(data: np.ndarray, qtype: int) -> torch.Tensor:
    """A tensor's values as the gguf package reads them: a float type as itself, a quantized one dequantized
    to bfloat16."""
    kind = QT(qtype)
    if kind in _FLOATS:
        if kind == QT.BF16:
            return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16).contiguous()
        return torch.from_numpy(np.array(data)).to(_FLOATS[kind]).contiguous()
    return torch.from_numpy(dequantize(np.asarray(data), kind).copy()).to(torch.bfloat16).contiguous()


def write_checkpoint(path: Path, out: Path, layout: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's config.json and dequantized safetensors written into the folder out; returns the config and
    each tensor's bytes. UnreadableMetadata for a file whose metadata lacks what its config needs."""
    from skulk.models.shards import write_safetensors

    reader = GGUFReader(path)
    config = hf_config(metadata(reader), layout["tensors"])
    sizes = write_safetensors(hf_tensors(reader, config), out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return config, sizes
