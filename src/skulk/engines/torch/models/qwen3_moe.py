"""Qwen3-MoE: the Qwen3 layer (q/k RMSNorm) whose MLP is a sparse mixture of experts (moe.SparseMoe) on its sparse
layers and a dense one elsewhere."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelArgs
from ..layers import MLP, AllReduce, DecoderLayer
from ..moe import SparseMoe
from .family import Family


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Layer i is sparse unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0. Hub configs
    say num_experts; transformers 5 writes num_local_experts."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return {"qk_norm": True}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return {
        "qk_norm": True,
        "num_experts": int(experts),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "sparse_layers": sparse,
    }


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    mlp = SparseMoe(args, tp_size, reduce) if index in args.sparse_layers else MLP(args, tp_size, reduce)
    return DecoderLayer(args, tp_size, reduce, mlp, args.is_sliding(index))


FAMILY = Family(("qwen3_moe",), layer, fields)
