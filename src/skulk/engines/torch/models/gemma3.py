"""Gemma 3 (text; a multimodal `gemma3` checkpoint's language model, config.text_config unwraps it).

A Llama-shaped decoder with: token embeddings scaled by sqrt(hidden_size); RMSNorm scaling by (1 + weight); q/k
RMSNorm per head; attention scaled by query_pre_attn_scalar ** -0.5; four norms per layer (before and after
attention, before and after the MLP, the "after" ones applied before the residual add); a GELU-tanh MLP;
interleaved local layers that attend through a sliding window (config.window_fields) and rotate with their own
rope base; optional softcapping of attention scores and final logits; tied embeddings. The shared blocks (norm,
attention, MLP, rope) take those switches as arguments or from ModelArgs; this file holds the layer, the config
fields and the model-level hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..cache import LayerCache, StepBatch
from ..config import ModelArgs
from ..layers import MLP, AllReduce, Attention, RMSNorm
from .family import Family


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then h + post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = Attention(args, tp_size, all_reduce, unit_offset=True)
        self.mlp = MLP(args, tp_size, all_reduce, gelu=True)
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)

    def forward(
        self, x: torch.Tensor, batch: StepBatch, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerCache
    ) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch, rope, cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    return {
        "qk_norm": True,
        "rope_local_theta": float(cfg.get("rope_local_base_freq") or local.get("rope_theta") or 10_000.0),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    return GemmaDecoderLayer(args, tp_size, reduce, args.is_sliding(index))


def scale_embeddings(h: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Embeddings times sqrt(hidden_size), rounded to the activations' dtype as transformers does."""
    return h * torch.tensor(args.hidden_size**0.5, dtype=h.dtype)


FAMILY = Family(("gemma3_text", "gemma3"), layer, fields, scale_embeddings, norm_unit_offset=True)
