"""Sparse mixture-of-experts blocks: a router picks num_experts_per_tok experts per token, whose SwiGLU outputs
are summed with the router's weights. SparseMoe is Qwen3-MoE's (softmax router); GroupedMoe is GLM-4 MoE's and
DeepSeek V3's (sigmoid scores, a correction bias choosing, grouped top-k, always-on shared experts).

Tensor parallel: every rank holds a slice of every expert (gate/up split by rows, down by columns, as the dense
MLP), and the replicated router makes the same choice on every rank, so each rank's sum is a partial sum of the
block's output that one all_reduce per block completes. Pipeline: a stage holds its layers' experts whole.

Dispatch runs only the experts some token picked, each once over all the rows that picked it (sorted by
expert, gathered, scattered back with index_add_), so a decode step of B tokens costs at most B * k expert
MLPs of one row each, and a prefill groups its tokens into one matmul per expert. Where the C kernels run and
every expert is in their layout, that dispatch is one call (cpu_moe.c through cpu_kernels.MoeKernel: the same
matmuls and roundings without a dozen torch ops per expert), and a softmax-routed block runs inside its decoder
layer's one decode call (layers.DecoderLayer._describe), so a MoE model's decode step is one C call, as a dense
model's is.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .config import ModelArgs
from .layers import AllReduce, GatedMLP, identity, kernel_matrix
from .matmul import FLOAT_GEMM_ROWS, Linear
from .quant import QuantizedLinear


class Expert(GatedMLP):
    """One expert: a SiLU-gated MLP whose gate and up fuse_projections stacks, as the dense MLP's."""


class SparseMoe(nn.Module):
    """The block as Qwen3-MoE checkpoints name it: mlp.gate (the router) and mlp.experts.N.{gate,up,down}_proj."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce, router: nn.Module | None = None,
                 experts: nn.Module | None = None) -> None:
        """router: mlp.gate's module (a Linear unless given); experts: the experts' module, when a family keeps
        them otherwise than one Expert each (gpt-oss: stacked tensors; it then overrides run_expert)."""
        super().__init__()
        self.top_k, self.normalize = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = router if router is not None else Linear(args.hidden_size, args.num_experts, bias=False)
        inter = args.moe_intermediate_size // tp_size
        self.n_experts = args.num_experts
        self.experts = experts if experts is not None else nn.ModuleList(
            Expert(args.hidden_size, inter) for _ in range(args.num_experts))
        self.all_reduce = all_reduce
        self._kernel: cpu_kernels.MoeKernel | bool | None = None
        """The experts as cpu_moe.c runs them; None: not yet decided (after loading), False: they run in torch."""

    def kernel(self) -> cpu_kernels.MoeKernel | None:
        """The experts (and a linear router, for SparseMoe's own routing) as one cpu_moe.c call: where every expert is
        an Expert with SiLU, its gate/up stacked and both matrices in the kernels' layout (decided once, on first use
        after loading). GroupedMoe's experts run on it too, routed in torch; a family that runs its experts
        otherwise (gpt-oss's run_expert) gets None."""
        if self._kernel is None:
            self._kernel = self._build_kernel() or False
        return self._kernel if isinstance(self._kernel, cpu_kernels.MoeKernel) else None

    def _build_kernel(self) -> cpu_kernels.MoeKernel | None:
        if type(self).run_expert is not SparseMoe.run_expert or not isinstance(self.experts, nn.ModuleList):
            return None
        experts = [e for e in self.experts if isinstance(e, Expert) and not e.gelu]
        if len(experts) != self.n_experts:
            return None
        gate_up = [kernel_matrix(e.gate_up) for e in experts]
        down = [kernel_matrix(e.down_proj) for e in experts]
        router = kernel_matrix(self.gate) if isinstance(self.gate, Linear | QuantizedLinear) else None
        if any(m is None for m in (*gate_up, *down)):
            return None
        return cpu_kernels.MoeKernel(router, gate_up, down, self.top_k, self.normalize)  # type: ignore[arg-type]

    def kernel_for(self, flat: torch.Tensor, routed: bool = False) -> cpu_kernels.MoeKernel | None:
        """The C kernel for these rows (routed: with the routing too, layer_kernel's), where it computes what the
        torch path does as fast or faster: on the kernels' devices and dtypes, and for float experts only below
        FLOAT_GEMM_ROWS rows (from there on each expert's matmul is a GEMM in torch: a prefill's)."""
        if not cpu_kernels.handles(flat):
            return None
        kernel = self.layer_kernel() if routed else self.kernel()
        return kernel if kernel is not None and (kernel.any_rows or flat.shape[0] < FLOAT_GEMM_ROWS) else None

    def layer_kernel(self) -> cpu_kernels.MoeKernel | None:
        """The block whole (routing and experts) as a decoder layer's C call runs it: SparseMoe's softmax routing,
        one tensor-parallel rank."""
        routed = type(self).route is SparseMoe.route and type(self).forward is SparseMoe.forward
        kernel = self.kernel() if routed and self.all_reduce is identity else None
        return kernel if kernel is not None and kernel.routes else None

    def run_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's output for the rows that picked it."""
        return cast(nn.ModuleList, self.experts)[expert](rows)

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
        if (kernel := self.kernel_for(flat, routed=True)) is not None:
            return kernel(flat).view(x.shape)
        return self.all_reduce(self.mix(flat, *self.route(flat)).view(x.shape))

    def mix(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each row's picked experts' outputs times their weights, summed in the activations' dtype (each product
        rounded to it before the add, as transformers adds them)."""
        if (kernel := self.kernel_for(flat)) is not None:
            return kernel.mix(flat, weights, chosen)
        if flat.shape[0] == 1:
            return self._one_token(flat, weights[0], chosen[0])
        picks = chosen.reshape(-1)
        order = picks.argsort(stable=True)
        token = order // self.top_k
        weight = weights.reshape(-1)[order].unsqueeze(-1)
        counts = torch.bincount(picks, minlength=self.n_experts).tolist()
        out = torch.zeros_like(flat)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = token[start : start + count]
                y = self.run_expert(expert, flat[rows]) * weight[start : start + count]
                out.index_add_(0, rows, y.to(out.dtype))
                start += count
        return out

    def _one_token(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """A single-token decode: its k experts in ascending order (the order a batch sums them in), without
        the sort, gather and scatter a batch needs."""
        out = torch.zeros_like(flat)
        for weight, expert in sorted(zip(weights.unbind(), chosen.tolist(), strict=True), key=lambda p: p[1]):
            out += (self.run_expert(expert, flat) * weight).to(out.dtype)
        return out


class SigmoidRouter(nn.Module):
    """mlp.gate as GLM-4 MoE and DeepSeek V3 checkpoints name it: a weight [experts, hidden] (no Linear: it is
    never quantized) and the e_score_correction_bias that shifts which experts are chosen, not their weights.
    Logits in float32, as transformers keeps the router; the bias stays float32 whatever the model's dtype
    (float32_tensors: the loader reads it so), since rounding it would change which experts run."""

    float32_tensors = ("e_score_correction_bias",)

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.empty(experts, dtype=torch.float32))

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat.float(), self.weight.float())


def grouped_top_k(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] float32, expert ids [N, k]) from sigmoid scores [N, experts]: choose by score + bias
    among the experts of the topk_group groups whose two best biased scores sum highest, weigh by the unbiased
    score, optionally renormalised, times scale. transformers' Glm4MoeTopkRouter / DeepSeek V3's noaux_tc."""
    n, experts = scores.shape
    choice = scores + bias
    group_scores = choice.view(n, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    keep = keep.unsqueeze(-1).expand(n, n_group, experts // n_group).reshape(n, experts)
    chosen = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, chosen


class GroupedMoe(SparseMoe):
    """GLM-4 MoE's block (DeepSeek V3's too): a SigmoidRouter choosing by grouped top-k, the routed experts as
    SparseMoe runs them, plus mlp.shared_experts, one SwiGLU of n_shared_experts x moe_intermediate_size that
    every token runs. Tensor parallel: the shared experts split like the dense MLP; the block's one all_reduce
    completes routed and shared partial sums together."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce) -> None:
        super().__init__(args, tp_size, all_reduce, SigmoidRouter(args.hidden_size, args.num_experts))
        self.n_group, self.topk_group, self.scale = args.n_group, args.topk_group, args.routed_scaling_factor
        shared = args.moe_intermediate_size * args.n_shared_experts // tp_size
        self.shared_experts = Expert(args.hidden_size, shared) if shared else None

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights stay float32: transformers multiplies each expert's output by them before rounding."""
        assert isinstance(self.gate, SigmoidRouter)
        return grouped_top_k(self.gate(flat).sigmoid(), self.gate.e_score_correction_bias, self.top_k,
                             self.n_group, self.topk_group, self.normalize, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.mix(flat, *self.route(flat))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return self.all_reduce(out.view(x.shape))


def grouped_fields(cfg: dict[str, Any], experts: int, dense: int, *, intermediate: int, scale: float) -> dict[str, Any]:
    """The ModelArgs fields of a GroupedMoe decoder, as GLM-4 MoE's and DeepSeek V3's configs name them: experts
    from layer `dense` on. `intermediate` and `scale` are the defaults the two families' transformers configs
    differ in (moe_intermediate_size, routed_scaling_factor)."""
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size", intermediate)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "sparse_layers": tuple(range(dense, cfg["num_hidden_layers"])) if experts else (),
        "n_shared_experts": int(cfg.get("n_shared_experts", 1)),
        "n_group": int(cfg.get("n_group") or 1),
        "topk_group": int(cfg.get("topk_group") or 1),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", scale)),
    }
