"""The Llama family: Llama, Mistral, Qwen2 and Qwen3, one pre-norm layer shape with a SwiGLU MLP. Qwen2 adds a
q/k/v bias, Qwen3 a per-head q/k RMSNorm, Mistral an optional sliding window (config.window_fields). Its layers
run a decode step as one C call (layers.DecoderLayer.native)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelArgs
from ..layers import MLP, AllReduce, DecoderLayer
from .family import Family


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    model_type = cfg["model_type"]
    out: dict[str, Any] = {}
    if model_type == "qwen2":
        out["attention_bias"] = True
    if model_type == "qwen3":
        out["qk_norm"] = True
    return out


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    return DecoderLayer(args, tp_size, reduce, MLP(args, tp_size, reduce), args.is_sliding(index))


FAMILY = Family(("llama", "qwen2", "qwen3", "mistral"), layer, fields)
