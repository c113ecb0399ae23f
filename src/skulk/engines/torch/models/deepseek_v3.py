"""DeepSeek V3 and Kimi K2 (the same architecture; Kimi's published config names its own model_type, kimi_k2,
registered here beside deepseek_v3): GLM-4 MoE's decoder (dense layers before first_k_dense_replace, then
moe.GroupedMoe: sigmoid grouped top-k routing, a correction bias, shared experts) with Multi-head Latent
Attention. Their published checkpoints' block-scaled FP8 weights are held at 8 bits, requantized from their blocks
while loading (engines/torch/fp8.py), but kv_b_proj, kept float for the absorbed decode below.

MLA: queries through q_a_proj -> q_a_layernorm -> q_b_proj (q_proj when q_lora_rank is None); keys and values
from one latent, kv_a_proj_with_mqa giving kv_lora_rank + qk_rope_head_dim, the latent normed (kv_a_layernorm)
and expanded per head by kv_b_proj into a key part without position (qk_nope_head_dim) and a value (v_head_dim);
the rest is one rope key every head shares. The checkpoint's rope dimensions come interleaved in pairs: they are
gathered evens then odds and turned as the half-split layout, as transformers does (q and k alike, so the dot
products are DeepSeek's). Softmax scale (qk_nope + qk_rope)^-0.5, times YaRN's mscale_all_dim factor squared.

The cache holds the latent, as DeepSeek and vLLM do: per layer and position the normed latent and the turned
rope key, kv_lora_rank + qk_rope_head_dim elements, once. In the paged pools (cache.LayerCache: per head one key
and one value) that is one key head of that width and no values at all (value_dim 0): the values are the key's
first kv_lora_rank columns, so storing them apart would only double the bytes. The card's arithmetic (models/
memory_math.cache_shape: one latent head, whole on every tensor rank) is what the engine allocates.

A decode step (ABSORB_ROWS tokens a request) attends in latent space: kv_b_proj's key part absorbed into each
head's query (q_nope @ W_uk, then scores against the cached latents, the rope parts against the rope key) and its
value part into the output (softmax over the latents, then @ W_uv), never expanding the past. A longer run (a
prefill chunk) expands the cached latents through kv_b_proj into per-head keys and values and attends over them:
fewer multiplications when many queries share the expansion. A kv_b_proj quantized at load (no float weight to
absorb) always expands. No CPU decode kernel runs this attention (cpu_kernels reads layers.Attention only).

The multi-token-prediction layers (num_nextn_predict_layers, after the last decoder layer) are not loaded."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import LayerCache, MixedBatch, StepBatch
from ..config import MlaShape, ModelArgs
from ..layers import MLP, AllReduce, DecoderLayer, RMSNorm, Rotation, _rotate, yarn_mscale
from ..matmul import Linear
from ..moe import GroupedMoe, grouped_fields
from .family import Family

Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One step's queries [B, T, heads * qk], normed latents [B, T, kv_lora_rank], rope keys [B, T, r] (unturned)."""


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MLA widths and the MoE fields, with transformers' DeepseekV3Config defaults where a config omits
    them. head_dim and num_key_value_heads are the cache's: one latent (kv_lora_rank) and its rope key a position."""
    nope, rope = int(cfg.get("qk_nope_head_dim", 128)), int(cfg.get("qk_rope_head_dim", 64))
    v = int(cfg.get("v_head_dim") or 128)
    experts = int(cfg.get("n_routed_experts") or 0)
    dense = int(cfg.get("first_k_dense_replace", 3))
    q_rank, kv_rank = cfg.get("q_lora_rank", 1536), int(cfg.get("kv_lora_rank", 512))
    return {
        "num_key_value_heads": 1,
        "head_dim": kv_rank + rope,
        "rotary_dim": rope,
        "mla": MlaShape(int(q_rank) if q_rank else None, kv_rank, nope, rope, v,
                        bool(cfg.get("rope_interleave", True)), _softmax_scale(cfg, nope + rope)),
        **grouped_fields(cfg, experts, dense, intermediate=2048, scale=2.5),
    }


def _softmax_scale(cfg: dict[str, Any], qk_dim: int) -> float:
    """qk_dim^-0.5, times mscale^2 for a scaled rope with mscale_all_dim (transformers' yarn_apply_mscale)."""
    scale = qk_dim**-0.5
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in (None, "default") and rope.get("mscale_all_dim"):
        mscale = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * mscale * mscale
    return scale


class MlaAttention(nn.Module):
    """Multi-head latent attention over a latent cache (see the module's docstring): absorbed for decode rows,
    expanded from the cached latents for longer runs of tokens. Tensor parallel: q_b_proj (or q_proj) and kv_b_proj
    split by heads, o_proj by columns; the low-rank projections, their norms and the cache are whole on every
    rank."""

    ABSORB_ROWS = 1
    """Tokens per request up to which a step attends in the absorbed form (decode; a prefill chunk expands)."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce) -> None:
        super().__init__()
        mla = args.mla
        assert mla is not None
        if args.attention_bias and tp_size > 1:
            raise ValueError("deepseek_v3 with attention_bias: o_proj's bias does not split over tensor ranks")
        self.mla, self.n_heads = mla, args.num_attention_heads // tp_size
        hidden, bias, qk = args.hidden_size, args.attention_bias, mla.nope_dim + mla.rope_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, self.n_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = Linear(mla.q_lora_rank, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = Linear(mla.kv_lora_rank, self.n_heads * (mla.nope_dim + mla.v_dim), bias=False)
        self.o_proj = Linear(self.n_heads * mla.v_dim, hidden, bias=bias)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor, batch: StepBatch | MixedBatch, rope: Rotation | tuple[Rotation, ...],
                cache: LayerCache) -> torch.Tensor:
        b, t, _ = x.shape
        projected = self._project(x)
        if isinstance(batch, MixedBatch):  # each part's attention on its own rows, in order
            parts = zip(*(p.split(batch.sizes, dim=1) for p in projected), batch.parts,
                        cast(tuple[Rotation, ...], rope), strict=True)
            outs = []
            for q, latent, k_rot, part, turn in parts:
                rows, n = part.positions.shape
                shaped = (q.reshape(rows, n, -1), latent.reshape(rows, n, -1), k_rot.reshape(rows, n, -1))
                outs.append(self._attend(shaped, part, turn, cache).transpose(1, 2).reshape(1, rows * n, -1))
            out = torch.cat(outs, dim=1)
        else:
            out = self._attend(projected, batch, cast(Rotation, rope), cache).transpose(1, 2)
        return self.all_reduce(self.o_proj(out.reshape(b, t, -1)))

    def _project(self, x: torch.Tensor) -> Projected:
        mla = self.mla
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.rope_dim], dim=-1)
        return q, self.kv_a_layernorm(latent), k_rot

    def _attend(self, projected: Projected, batch: StepBatch, rope: Rotation, cache: LayerCache) -> torch.Tensor:
        """Rope turned on the rope parts, the latent and rope key stored, attended; returns [B, heads, T, v_dim]."""
        mla, heads = self.mla, self.n_heads
        q, latent, k_rot = projected
        b, t, _ = q.shape
        q_nope, q_rot = q.view(b, t, heads, -1).transpose(1, 2).split([mla.nope_dim, mla.rope_dim], dim=-1)
        k_rot = k_rot.view(b, 1, t, mla.rope_dim)
        if mla.interleaved:
            q_rot, k_rot = _halves(q_rot), _halves(k_rot)
        q_rot, k_rot = _rotate(q_rot, *rope), _rotate(k_rot, *rope)
        entry = torch.cat((latent.view(b, 1, t, mla.kv_lora_rank), k_rot), dim=-1)
        keys, _ = cache.update(entry, entry[..., :0], batch)  # [B, 1, kv_len, rank + rope]; no values of their own
        weight = self.kv_b_proj.weight
        if t <= self.ABSORB_ROWS and weight.is_floating_point():
            w_uk, w_uv = weight.view(heads, mla.nope_dim + mla.v_dim, mla.kv_lora_rank).split(
                [mla.nope_dim, mla.v_dim], dim=1)
            q = torch.cat((q_nope @ w_uk, q_rot), dim=-1)  # each head's query in latent space: [B, H, T, rank + r]
            out = _attention(q, keys, keys[..., : mla.kv_lora_rank], batch.mask, mla.scale)  # [B, H, T, rank]
            return out @ w_uv.transpose(1, 2)
        kv = self.kv_b_proj(keys[:, 0, :, : mla.kv_lora_rank])  # every cached position's heads: [B, kv_len, ...]
        k_nope, v = kv.view(b, -1, heads, mla.nope_dim + mla.v_dim).transpose(1, 2).split(
            [mla.nope_dim, mla.v_dim], dim=-1)
        k = torch.cat((k_nope, keys[..., mla.kv_lora_rank:].expand(b, heads, -1, mla.rope_dim)), dim=-1)
        return _attention(torch.cat((q_nope, q_rot), dim=-1), k, v, batch.mask, mla.scale)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of q [B, H, T, D] over k [B, H or 1, S, D] and v [B, H or 1, S, Dv] (one latent head
    shared by every query head)."""
    gqa = k.shape[1] != q.shape[1]
    if q.dtype == torch.float16 and q.device.type == "cpu":  # torch's f16 attention on the CPU: 2x f32's time
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                              enable_gqa=gqa).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3), ... as evens then odds: the half-split layout layers._rotate turns."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    mlp = GroupedMoe(args, tp_size, reduce) if index in args.sparse_layers else MLP(args, tp_size, reduce)
    """Pre-norm MLA then the MLP (dense or GroupedMoe), each added to the residual; every layer attends to the
    whole context."""
    return DecoderLayer(args, tp_size, reduce, mlp, attention=MlaAttention(args, tp_size, reduce))


FAMILY = Family(("deepseek_v3", "kimi_k2"), layer, fields)
