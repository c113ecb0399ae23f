"""Each decoder layer's kind and weight tensors, read from config.json's dimensions, for every family placement
counts (models/memory_math.py turns them into bytes).

The tensors are named as mlx-lm names its modules (a mixed-precision mlx-community config's per-layer
quantization overrides are keyed so), with each MoE layer's experts stacked in one tensor per projection
(mlx-lm's `switch_mlp`). A tensor is `quantizable` when it is a Linear or Embedding weight, the ones an affine,
MXFP4 or FP8 layout packs; norms, biases, convolutions and DeepSeek's router stay in float.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from skulk.types.model_memory import LayerKind

MLA_TYPES = frozenset({"deepseek_v3", "deepseek_v32", "kimi_k2", "deepseek_v2"})
"""DeepSeek's architecture (Kimi K2 is one): MLA attention, a router without a Linear (not quantized by mlx-lm)."""
_RAW_ROUTER = MLA_TYPES | {"glm4_moe"}
_GATED_ATTENTION = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"})
"""Qwen3-Next and Qwen3.5 (its wrapper's and language model's types): a gate per head on q_proj, a gated shared
expert."""
_QK_NORM = frozenset({"qwen3", "qwen3_moe", "gemma3_text", "gemma3"}) | _GATED_ATTENTION
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                "linear_attention": "linear", "attention": "full", "mamba": "ssm", "mlp": "mlp", "moe": "mlp"}
_PATTERN = {"M": "ssm", "*": "full", "-": "mlp", "E": "mlp"}
"""Nemotron-H's hybrid_override_pattern: Mamba 2, attention, MLP, MoE blocks."""


@dataclass(frozen=True)
class Tensor:
    """One weight: its mlx-lm module path, shape, and whether a quantized layout packs it."""

    path: str
    shape: tuple[int, ...]
    quantizable: bool = False
    expert: bool = False
    """A routed expert's stacked projection (gpt-oss ships only these in MXFP4)."""


def text_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a multimodal checkpoint's text_config with the top level's dtype, tie and
    quantization keys (Gemma 3, Llama 4), else the config itself; the layer count from the block list where a
    transformers 5 Nemotron-H keeps it only there (layers_block_type)."""
    inner = config.get("text_config")
    if not isinstance(inner, dict) or config.get("num_hidden_layers"):
        blocks = config.get("layers_block_type")
        if not config.get("num_hidden_layers") and isinstance(blocks, list):
            return {**config, "num_hidden_layers": len(blocks)}
        return config
    merged = dict(inner)
    for key in ("torch_dtype", "dtype", "tie_word_embeddings", "quantization", "quantization_config"):
        if key in config and key not in merged:
            merged[key] = config[key]
    return merged


def head_dim(c: dict[str, Any]) -> int:
    return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def layer_kinds(c: dict[str, Any]) -> list[LayerKind]:
    """Each decoder layer's kind (types/model_memory.LayerKind), from layer_types or the family's own keys."""
    n = int(c["num_hidden_layers"])
    model_type = str(c.get("model_type", ""))
    if pattern := c.get("hybrid_override_pattern"):
        return [_PATTERN[ch] for ch in str(pattern)]  # type: ignore[misc]
    types = c.get("layer_types") or c.get("layers_block_type")
    if types and len(types) == n:
        mamba = "mamba_num_heads" in c  # transformers 5 saves Nemotron-H's Mamba blocks as "linear_attention"
        return ["ssm" if mamba and t == "linear_attention" else _LAYER_TYPES[t] for t in types]  # type: ignore[misc]
    if c.get("kv_lora_rank"):
        return ["mla"] * n
    if model_type in _GATED_ATTENTION:
        interval = int(c.get("full_attention_interval") or 4)
        return ["full" if (i + 1) % interval == 0 else "linear" for i in range(n)]
    if model_type in ("llama4", "llama4_text"):
        rope = c.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(n)]
        chunked = bool(c.get("attention_chunk_size"))
        return [("chunked" if chunked else "full") if rope[i] else "nope" for i in range(n)]
    if model_type in ("gemma3_text", "gemma3"):
        every = int(c.get("sliding_window_pattern") or 6)
        return ["sliding" if (i + 1) % every else "full" for i in range(n)]
    if model_type == "mistral" and c.get("sliding_window"):
        return ["sliding"] * n
    return ["full"] * n


def moe_layers(c: dict[str, Any]) -> set[int]:
    """The layers whose feed-forward is a mixture of experts (all experts resident)."""
    n = int(c["num_hidden_layers"])
    model_type = str(c.get("model_type", ""))
    experts = _experts(c)
    if not experts:
        return set()
    if pattern := c.get("hybrid_override_pattern"):
        return {i for i, ch in enumerate(str(pattern)) if ch == "E"}
    if blocks := c.get("layers_block_type"):
        return {i for i, t in enumerate(blocks) if t == "moe"}
    if "first_k_dense_replace" in c:
        every = int(c.get("moe_layer_freq") or 1)
        return {i for i in range(int(c["first_k_dense_replace"]), n) if i % every == 0}
    if model_type in ("llama4", "llama4_text"):
        step = int(c.get("interleave_moe_layer_step") or 1)
        return set(range(step - 1, n, step))
    dense = set(c.get("mlp_only_layers") or [])
    step = int(c.get("decoder_sparse_step") or 1)
    return {i for i in range(n) if i not in dense and (i + 1) % step == 0}


def _experts(c: dict[str, Any]) -> int:
    return int(c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0)


def layer_tensors(c: dict[str, Any], i: int, kind: LayerKind, moe: bool) -> list[Tensor]:
    """Every weight of decoder layer i."""
    p = f"model.layers.{i}"
    h = int(c["hidden_size"])
    blocks = bool(c.get("hybrid_override_pattern") or c.get("layers_block_type"))
    norms = 1 if blocks else 4 if str(c.get("model_type", "")).startswith("gemma3") else 2
    out = [Tensor(f"{p}.norm{j}", (h,)) for j in range(norms)]
    if blocks:  # Nemotron-H: each layer one block (Mamba 2, attention, MLP or MoE), one norm before it
        return out + _block(c, p, kind, moe)
    if kind == "mla":
        out += _mla(c, p)
    elif kind == "linear":
        out += _gated_delta(c, p)
    else:
        out += _attention(c, p)
    return out + (_moe(c, p) if moe else _mlp(c, p, _dense_inter(c)))


def _block(c: dict[str, Any], p: str, kind: LayerKind, moe: bool) -> list[Tensor]:
    """A Nemotron-H block's weights; its MLP is relu²: up and down, no gate."""
    if kind == "ssm":
        return _mamba2(c, p)
    if kind != "mlp":
        return list(_attention(c, p))
    if moe:
        return _moe(c, p)
    h, inter = int(c["hidden_size"]), int(c["intermediate_size"])
    return [Tensor(f"{p}.mixer.up_proj", (inter, h), True), Tensor(f"{p}.mixer.down_proj", (h, inter), True)]


def _attention(c: dict[str, Any], p: str) -> Iterator[Tensor]:
    h, d = int(c["hidden_size"]), head_dim(c)
    heads, kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    model_type = str(c.get("model_type", ""))
    gate = 2 if model_type in _GATED_ATTENTION else 1  # Qwen3-Next's gated attention: the gate rides on q_proj
    a = f"{p}.self_attn"
    yield Tensor(f"{a}.q_proj", (heads * d * gate, h), True)
    yield Tensor(f"{a}.k_proj", (kv * d, h), True)
    yield Tensor(f"{a}.v_proj", (kv * d, h), True)
    yield Tensor(f"{a}.o_proj", (h, heads * d), True)
    if c.get("attention_bias") or model_type == "qwen2":
        yield Tensor(f"{a}.qkv_bias", ((heads + 2 * kv) * d,))
    if c.get("attention_bias") and model_type in ("gpt_oss",):
        yield Tensor(f"{a}.o_bias", (h,))
    if model_type == "gpt_oss":
        yield Tensor(f"{a}.sinks", (heads,))
    if model_type == "minimax_m2" or (model_type == "minimax" and c.get("use_qk_norm")):
        yield Tensor(f"{a}.qk_norm", ((heads + kv) * d,))  # MiniMax normalises across all heads
    elif model_type in _QK_NORM or (c.get("use_qk_norm") and not model_type.startswith("llama4")):
        yield Tensor(f"{a}.qk_norm", (2 * d,))  # Llama 4's qk norm has no weights


def _mla(c: dict[str, Any], p: str) -> Iterator[Tensor]:
    """DeepSeek V3's multi-head latent attention: queries through a low-rank pair, keys and values from one
    latent of kv_lora_rank plus a shared rope key of qk_rope_head_dim (what the cache keeps)."""
    h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    rope, nope, v = int(c["qk_rope_head_dim"]), int(c["qk_nope_head_dim"]), int(c["v_head_dim"])
    latent, q_rank = int(c["kv_lora_rank"]), c.get("q_lora_rank")
    a = f"{p}.self_attn"
    if q_rank:
        yield Tensor(f"{a}.q_a_proj", (int(q_rank), h), True)
        yield Tensor(f"{a}.q_a_layernorm", (int(q_rank),))
        yield Tensor(f"{a}.q_b_proj", (heads * (nope + rope), int(q_rank)), True)
    else:
        yield Tensor(f"{a}.q_proj", (heads * (nope + rope), h), True)
    yield Tensor(f"{a}.kv_a_proj_with_mqa", (latent + rope, h), True)
    yield Tensor(f"{a}.kv_a_layernorm", (latent,))
    yield Tensor(f"{a}.kv_b_proj", (heads * (nope + v), latent), True)
    yield Tensor(f"{a}.o_proj", (h, heads * v), True)


def _gated_delta(c: dict[str, Any], p: str) -> Iterator[Tensor]:
    """Qwen3-Next's gated DeltaNet: q, k, v and the output gate z from one projection, a causal convolution
    over q, k and v, a per-head decay (A_log, dt_bias) and a gated norm."""
    h = int(c["hidden_size"])
    kh, kd = int(c["linear_num_key_heads"]), int(c["linear_key_head_dim"])
    vh, vd = int(c["linear_num_value_heads"]), int(c["linear_value_head_dim"])
    a = f"{p}.linear_attn"
    yield Tensor(f"{a}.in_proj_qkvz", (2 * kh * kd + 2 * vh * vd, h), True)
    yield Tensor(f"{a}.in_proj_ba", (2 * vh, h), True)
    yield Tensor(f"{a}.conv1d", (2 * kh * kd + vh * vd, 1, int(c.get("linear_conv_kernel_dim") or 4)))
    yield Tensor(f"{a}.decay", (2 * vh,))  # A_log and dt_bias
    yield Tensor(f"{a}.norm", (vd,))
    yield Tensor(f"{a}.out_proj", (h, vh * vd), True)


def _mamba2(c: dict[str, Any], p: str) -> list[Tensor]:
    """Nemotron-H's Mamba 2 mixer: x, z, B, C and dt from one projection, a convolution over x, B and C."""
    h, heads, state, groups = (int(c["hidden_size"]), int(c["mamba_num_heads"]), int(c["ssm_state_size"]),
                               int(c.get("n_groups") or 1))
    inner = heads * int(c["mamba_head_dim"])
    conv = inner + 2 * groups * state
    m = f"{p}.mixer"
    return [Tensor(f"{m}.in_proj", (2 * inner + 2 * groups * state + heads, h), True),
            Tensor(f"{m}.conv1d", (conv, 1, int(c.get("conv_kernel") or 4))), Tensor(f"{m}.conv1d_bias", (conv,)),
            Tensor(f"{m}.decay", (3 * heads,)), Tensor(f"{m}.norm", (inner,)),  # A_log, D, dt_bias
            Tensor(f"{m}.out_proj", (h, inner), True)]


def _dense_inter(c: dict[str, Any]) -> int:
    return int(c.get("intermediate_size_mlp") or c["intermediate_size"])  # Llama 4: its dense layers' width


def _mlp(c: dict[str, Any], p: str, inter: int, name: str = "mlp") -> list[Tensor]:
    h = int(c["hidden_size"])
    return [Tensor(f"{p}.{name}.gate_proj", (inter, h), True), Tensor(f"{p}.{name}.up_proj", (inter, h), True),
            Tensor(f"{p}.{name}.down_proj", (h, inter), True)]


def _moe(c: dict[str, Any], p: str) -> list[Tensor]:
    """Every routed expert (stacked) and shared expert, and the router."""
    h, e = int(c["hidden_size"]), _experts(c)
    inter = int(c.get("moe_intermediate_size") or c["intermediate_size"])
    model_type = str(c.get("model_type", ""))
    s = f"{p}.mlp.switch_mlp"
    if model_type == "gpt_oss":  # fused gate/up with biases, and a router with a bias
        out = [Tensor(f"{s}.gate_up_proj", (e, 2 * inter, h), True, True), Tensor(f"{s}.gate_up_bias", (e, 2 * inter)),
               Tensor(f"{s}.down_proj", (e, h, inter), True, True), Tensor(f"{s}.down_bias", (e, h)),
               Tensor(f"{p}.mlp.router", (e, h), True), Tensor(f"{p}.mlp.router_bias", (e,))]
        return out
    up = [] if c.get("hybrid_override_pattern") or c.get("layers_block_type") else ["gate_proj"]
    out = [Tensor(f"{s}.{name}", (e, inter, h), True, True) for name in [*up, "up_proj"]]
    out.append(Tensor(f"{s}.down_proj", (e, h, inter), True, True))
    out.append(Tensor(f"{p}.mlp.gate", (e, h), model_type not in _RAW_ROUTER))
    if c.get("topk_method") == "noaux_tc" or model_type in _RAW_ROUTER:
        out.append(Tensor(f"{p}.mlp.gate.e_score_correction_bias", (e,)))
    shared = _shared_inter(c, inter)
    if shared and up:
        out += _mlp(c, p, shared, "mlp.shared_experts")
    elif shared:  # Nemotron-H's relu² shared expert: up and down
        out += [Tensor(f"{p}.mlp.shared_experts.up_proj", (shared, h), True),
                Tensor(f"{p}.mlp.shared_experts.down_proj", (h, shared), True)]
    if model_type in _GATED_ATTENTION:
        out.append(Tensor(f"{p}.mlp.shared_expert_gate", (1, h), True))
    return out


def _shared_inter(c: dict[str, Any], inter: int) -> int:
    """The shared experts' total width (DeepSeek: n_shared_experts of moe_intermediate_size; Qwen3-Next its own
    size; Llama 4 one of intermediate_size; Nemotron-H its own size per shared expert)."""
    model_type = str(c.get("model_type", ""))
    if model_type in ("llama4", "llama4_text"):
        return int(c["intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        return int(c["shared_expert_intermediate_size"])
    shared = int(c.get("n_shared_experts") or 0)
    return shared * int(c.get("moe_shared_expert_intermediate_size") or inter)


def mtp_tensors(c: dict[str, Any]) -> list[Tensor]:
    """The multi-token-prediction layers the files carry past the decoder, which no rank runs (mlx-lm's sanitize
    and transformers drop them on load, the torch engine never asks for them).

    DeepSeek's and GLM's (num_nextn_predict_layers, stored as model.layers.{n+j}): each a full MoE layer, a
    projection of [embedding; hidden] to hidden, three norms, and, in DeepSeek's files, its own copies of the
    embedding and the head. Qwen3-Next's and Qwen3.5's (_qwen_mtp): under mtp., sharing the model's embedding and
    head."""
    if str(c.get("model_type", "")) in _GATED_ATTENTION:
        return _qwen_mtp(c)
    n, h = int(c["num_hidden_layers"]), int(c["hidden_size"])
    out: list[Tensor] = []
    for j in range(int(c.get("num_nextn_predict_layers") or 0)):
        i = n + j
        out += layer_tensors(c, i, "mla" if c.get("kv_lora_rank") else "full", True)
        out += [Tensor(f"model.layers.{i}.eh_proj", (h, 2 * h), True), Tensor(f"model.layers.{i}.norms", (3 * h,))]
        if str(c.get("model_type", "")) in MLA_TYPES:
            vocab = int(c["vocab_size"])
            out += [Tensor(f"model.layers.{i}.embed_tokens", (vocab, h), True),
                    Tensor(f"model.layers.{i}.shared_head.head", (vocab, h), True)]
    return out


def _qwen_mtp(c: dict[str, Any]) -> list[Tensor]:
    """Qwen3-Next's and Qwen3.5's multi-token-prediction block as their published files keep it: mtp.fc
    [hidden, 2 x hidden] over [embedding; hidden], the norms mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden and
    mtp.norm, and mtp_num_hidden_layers decoder layers mtp.layers.{j}, each a gated full-attention layer with the
    model's feed-forward (its MoE and gated shared expert in the MoE models); no embedding or head of its own
    (vLLM's qwen3_next_mtp.py and qwen3_5_mtp.py read the model's). Qwen3.5's text_config says
    mtp_num_hidden_layers (1); Qwen3-Next's published config names no count though its files hold one layer."""
    default = 1 if c.get("model_type") == "qwen3_next" else 0
    layers = int(c.get("mtp_num_hidden_layers", default) or 0)
    if not layers:
        return []
    n, h = int(c["num_hidden_layers"]), int(c["hidden_size"])
    out = [Tensor("mtp.fc", (h, 2 * h), True), Tensor("mtp.norms", (3 * h,))]
    for j in range(layers):
        inner = f"model.layers.{n + j}."
        out += [Tensor(t.path.replace(inner, f"mtp.layers.{j}.", 1), t.shape, t.quantizable, t.expert)
                for t in layer_tensors(c, n + j, "full", bool(_experts(c)))]
    return out
