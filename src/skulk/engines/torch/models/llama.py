"""The Llama family: Llama, Mistral, Qwen2 and Qwen3, one pre-norm layer shape with a SwiGLU MLP. Qwen2 adds a
q/k/v bias, Qwen3 a per-head q/k RMSNorm, Mistral an optional sliding window (config.window_fields). Qwen2.5-VL's
language model is Qwen2's with multimodal rope (mrope_section; mrope.py). Its layers run a decode step as one C
call (layers.DecoderLayer.native)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelArgs
from ..layers import MLP, AllReduce, DecoderLayer
from .family import Family


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    model_type = cfg["model_type"]
    out: dict[str, Any] = {}
    if model_type in ("qwen2", "qwen2_5_vl"):
        out["attention_bias"] = True
    if model_type == "qwen2_5_vl":
        out.update(_mrope(cfg))
    if model_type == "qwen3":
        out["qk_norm"] = True
    return out


def _mrope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2.5-VL's rope: the published config says {"type": "mrope", "mrope_section": [...]} under rope_scaling,
    transformers 5's {"rope_type": "default", ...} under rope_parameters; either way the frequencies are plain rope's
    (no scaling) and the section splits them among the three positions."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    section = rope.get("mrope_section") or [16, 24, 24]  # transformers' default
    return {"rope_scaling": None, "mrope_section": tuple(int(n) for n in section)}


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    return DecoderLayer(args, tp_size, reduce, MLP(args, tp_size, reduce), args.is_sliding(index))


FAMILY = Family(("llama", "qwen2", "qwen3", "mistral", "qwen2_5_vl"), layer, fields)
