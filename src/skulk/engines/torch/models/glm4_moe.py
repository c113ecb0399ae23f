"""GLM-4 MoE (GLM-4.5, GLM-4.5-Air, GLM-4.6): a pre-norm decoder whose first first_k_dense_replace layers have
a dense SwiGLU MLP and the rest a mixture of experts with shared experts and a sigmoid, grouped top-k router
(moe.GroupedMoe). Its attention: a q/k/v bias (attention_bias), an optional per-head q/k RMSNorm (use_qk_norm),
and rope over only the first partial_rotary_factor of each head (half on the released checkpoints), which keeps
its layers off the one-call decode kernel (layers.DecoderLayer._describe).

A checkpoint's multi-token-prediction layer (num_nextn_predict_layers, stored after the last decoder layer) is
not loaded: the engine reads only the tensors of the layers it builds.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelArgs
from ..layers import MLP, AllReduce, DecoderLayer
from ..moe import GroupedMoe, grouped_fields
from .family import Family


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes partial_rotary_factor under rope_parameters and num_local_experts beside
    n_routed_experts; a hub config has them at the top. The factor's default is transformers' (0.5)."""
    rope = cfg.get("rope_parameters") or {}
    factor = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5)))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    dense = int(cfg.get("first_k_dense_replace", 1))
    return {
        "qk_norm": bool(cfg.get("use_qk_norm", False)),
        "rotary_dim": int(head_dim * factor),
        **grouped_fields(cfg, experts, dense, intermediate=1408, scale=1.0),
    }


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    mlp = GroupedMoe(args, tp_size, reduce) if index in args.sparse_layers else MLP(args, tp_size, reduce)
    return DecoderLayer(args, tp_size, reduce, mlp)


FAMILY = Family(("glm4_moe",), layer, fields)
