"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a pre-norm decoder whose every layer is a mixture of experts, its
attention layers alternating between a sliding window and the whole context (config.window_fields: layer_types,
sliding_window), rope with YaRN (layers.Rope; gpt-oss's does not truncate its ramp).

Its attention: q/k/v and o biases, and a learned per-head sink, a logit that joins the softmax's denominator but
has no value, so a head can attend to nothing (GptOssAttention). Its MoE: a router with a bias choosing the top k
experts by logit, weighted by a softmax over the chosen k; each expert a SwiGLU with biases, its gate and up
interleaved column by column in one [hidden, 2 x width] tensor, clamped (gate at most limit, up within +-limit)
and gated as (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts). The experts stay stacked as
the checkpoint stores them ([experts, hidden, 2 x width], [experts, width, hidden], biases beside), so a float
checkpoint loads tensor for tensor; OpenAI's MXFP4 experts (`_blocks`/`_scales`) are dequantized while loading to
the model's dtype (mxfp4.py: exact in bfloat16, four times the packed bytes). Quantizing at load (int4/int8)
leaves the experts and the router in float: the experts are not Linears, and the router's error would flip
which experts run.

Tensor parallel: heads split as layers.Attention splits them, each expert's width split in whole gate/up pairs
(model.tp_split_dim), the o_proj and down biases added by rank 0 only (model.partial_sum_bias). No CPU decode
kernel runs these layers (sinks, biases after the reduce, stacked experts): they take the torch path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import LayerCache
from ..config import ModelArgs
from ..layers import AllReduce, Attention, DecoderLayer
from ..matmul import Linear
from ..moe import SparseMoe
from .family import Family


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The experts (intermediate_size is their width: there is no dense MLP) and the clamped SwiGLU, with
    transformers' GptOssConfig defaults where a config omits them."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 128)
    return {
        "attention_bias": bool(cfg.get("attention_bias", True)),
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4),
        "moe_intermediate_size": int(cfg["intermediate_size"]),
        "sparse_layers": tuple(range(cfg["num_hidden_layers"])),
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
    }


class GptOssAttention(Attention):
    """layers.Attention with an o_proj bias and sinks: softmax over [scores, sink] per head, the sink's share
    dropped, in float32 (a fused attention has no place for the extra logit)."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce) -> None:
        super().__init__(args, tp_size, all_reduce)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.attention_bias)
        self.sinks = nn.Parameter(torch.empty(self.n_heads))

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        scores = (q.float() @ keys.float().transpose(-1, -2)) * (self.scale or self.head_dim**-0.5)
        scores = scores.masked_fill(~mask, float("-inf"))
        b, h, t, _ = scores.shape
        sinks = self.sinks.float().view(1, h, 1, 1).expand(b, h, t, 1)
        probs = torch.cat((scores, sinks), dim=-1).softmax(-1)[..., :-1]
        return probs.to(values.dtype) @ values

    def _decodes_on_kernels(self, x: torch.Tensor, cache: LayerCache) -> bool:
        return False  # the decode kernel's softmax has no sink


class GptOssExperts(nn.Module):
    """Every expert of a layer, stacked as the checkpoint names them (mlp.experts.gate_up_proj, ...); this
    rank's block of each expert's width."""

    def __init__(self, args: ModelArgs, tp_size: int) -> None:
        super().__init__()
        experts, hidden, width = args.num_experts, args.hidden_size, args.moe_intermediate_size // tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * width))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * width))
        self.down_proj = nn.Parameter(torch.empty(experts, width, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.limit, self.alpha = args.swiglu_limit, args.swiglu_alpha

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """transformers' GptOssExperts for one expert, op for op (matmul then bias, as it adds them)."""
        gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj[expert] + self.down_proj_bias[expert]


class GptOssRouter(nn.Module):
    """mlp.router: a weight [experts, hidden] and a bias, in the activations' dtype as transformers runs it (not
    a Linear, so quantizing at load leaves it float)."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.bias = nn.Parameter(torch.empty(experts))

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat, self.weight, self.bias)


class GptOssMoe(SparseMoe):
    """SparseMoe's dispatch over gpt-oss's router and stacked experts: top k by logit, then a softmax over
    those k (in the activations' dtype, as transformers computes it)."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce) -> None:
        super().__init__(args, tp_size, all_reduce, GptOssRouter(args.hidden_size, args.num_experts),
                         GptOssExperts(args, tp_size))
        self.router = self.gate  # the checkpoint's name for it
        del self.gate

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, chosen = self.router(flat).topk(self.top_k, dim=-1)
        return logits.softmax(-1), chosen

    def run_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.experts, GptOssExperts)
        return self.experts.run(expert, rows)


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    """Pre-norm attention with sinks (windowed on sliding layers) then the MoE, each added to the residual."""
    return DecoderLayer(args, tp_size, reduce, GptOssMoe(args, tp_size, reduce), args.is_sliding(index),
                        GptOssAttention(args, tp_size, reduce))


FAMILY = Family(("gpt_oss",), layer, fields)
