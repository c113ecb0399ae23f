"""Qwen3-MoE's sparse mixture-of-experts block: a router picks num_experts_per_tok experts per token, whose
SwiGLU outputs are summed with the router's weights.

Tensor parallel: every rank holds a slice of every expert (gate/up split by rows, down by columns, as the dense
MLP), and the replicated router makes the same choice on every rank, so each rank's sum is a partial sum of the
block's output that one all_reduce per block completes. Pipeline: a stage holds its layers' experts whole.

Dispatch runs only the experts some token picked, each once over all the rows that picked it (sorted by
expert, gathered, scattered back with index_add_), so a decode step of B tokens costs at most B * k expert
MLPs of one row each, and a prefill groups its tokens into one matmul per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs
from .layers import AllReduce, GatedMLP
from .matmul import Linear


class Expert(GatedMLP):
    """One expert: a SiLU-gated MLP whose gate and up fuse_projections stacks, as the dense MLP's."""


class SparseMoe(nn.Module):
    """The block as Qwen3-MoE checkpoints name it: mlp.gate (the router) and mlp.experts.N.{gate,up,down}_proj."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce) -> None:
        super().__init__()
        self.top_k, self.normalize = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        inter = args.moe_intermediate_size // tp_size
        self.experts = nn.ModuleList(Expert(args.hidden_size, inter) for _ in range(args.num_experts))
        self.all_reduce = all_reduce

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in the activations' dtype, expert ids [N, k]): softmax in float32, top k, optionally
        renormalised to sum to one, as transformers does."""
        probs = F.softmax(self.gate(flat).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(flat.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat)
        if flat.shape[0] == 1:
            return self.all_reduce(self._one_token(flat, weights[0], chosen[0]).view(x.shape))
        picks = chosen.reshape(-1)
        order = picks.argsort(stable=True)
        token = order // self.top_k
        weight = weights.reshape(-1)[order].unsqueeze(-1)
        counts = torch.bincount(picks, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(flat)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = token[start : start + count]
                y = self.experts[expert](flat[rows]) * weight[start : start + count]
                out.index_add_(0, rows, y.to(out.dtype))
                start += count
        return self.all_reduce(out.view(x.shape))

    def _one_token(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """A single-token decode: its k experts in ascending order (the order a batch sums them in), without
        the sort, gather and scatter a batch needs."""
        out = torch.zeros_like(flat)
        for weight, expert in sorted(zip(weights.unbind(), chosen.tolist(), strict=True), key=lambda p: p[1]):
            out += self.experts[expert](flat) * weight
        return out
