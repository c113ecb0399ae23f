"""Gemma 3's decoder layer and its model-level differences from the Llama family.

Gemma 3 (text) is a Llama-shaped decoder with: token embeddings scaled by sqrt(hidden_size); RMSNorm scaling by
(1 + weight); q/k RMSNorm per head; attention scaled by query_pre_attn_scalar ** -0.5; four norms per layer
(before and after attention, before and after the MLP, the "after" ones applied before the residual add); a
GELU-tanh MLP; interleaved local layers that attend through a sliding window and rotate with their own rope
base; optional softcapping of attention scores and final logits; tied embeddings. The shared pieces (norm,
attention, MLP, rope) take those switches from ModelArgs; this module holds the layer and the two model hooks.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import LayerCache, StepBatch
from .config import ModelArgs
from .layers import MLP, AllReduce, Attention, RMSNorm


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then h + post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = Attention(args, tp_size, all_reduce)
        self.mlp = MLP(args, tp_size, all_reduce)
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


def scale_embeddings(h: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Gemma multiplies embeddings by sqrt(hidden_size), rounded to the activations' dtype as transformers does."""
    return h * torch.tensor(args.hidden_size**0.5, dtype=h.dtype) if args.is_gemma else h


def softcap_logits(logits: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """cap * tanh(logits / cap) when the config sets final_logit_softcapping."""
    cap = args.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits
