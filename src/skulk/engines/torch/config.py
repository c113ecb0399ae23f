"""The architecture numbers the torch model needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """One Llama-family architecture. Qwen2 differs by qkv bias, Qwen3 by per-head q/k RMSNorm."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: torch.dtype

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; torch runs {SUPPORTED_MODEL_TYPES}")
        # transformers 5 writes rope settings under rope_parameters; hub configs use rope_theta/rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            dtype=parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelArgs:
        return cls.from_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a config string or a dtype; only the float types weights ship in."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
