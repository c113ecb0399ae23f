"""The torch engine's native model families, one file each, registered here by model_type.

A family file (llama.py, gemma3.py, qwen3_moe.py, glm4_moe.py, deepseek_v3.py, gpt_oss.py, qwen3_next.py,
qwen3_5.py) builds its layers from the shared blocks (layers.py: attention over the paged cache, MLPs, norms, rope;
moe.py: expert dispatch and routing) and says which config fields it reads beyond config.common_fields. This
registry is the one list of what runs natively (SUPPORTED_MODEL_TYPES: the catalog's native_types, the rest going
through the transformers fallback) and the one place a config becomes ModelArgs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from skulk.formats.checkpoint import read_config

from ..config import BIDIRECTIONAL_IMAGE_TYPES, ModelArgs, common_fields, is_vision_config, text_config
from ..layers import AllReduce
from . import deepseek_v3, gemma3, glm4_moe, gpt_oss, llama, qwen3_5, qwen3_moe, qwen3_next
from .family import Family

FAMILIES: dict[str, Family] = {
    t: f.FAMILY
    for f in (llama, gemma3, qwen3_moe, glm4_moe, deepseek_v3, gpt_oss, qwen3_next, qwen3_5)
    for t in f.FAMILY.model_types
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def family_of(args: ModelArgs) -> Family:
    return FAMILIES[args.model_type]


def read_args(cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs from a Hugging Face config.json's dict: a multimodal checkpoint's language model (text_config),
    the common fields and its family's own. ValueError for a model_type no family here runs."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; torch runs {SUPPORTED_MODEL_TYPES}")
    # a wrapper whose tower the engine does not run (Qwen3.5) reads text only: its image token is just a token
    image_token = cfg.get("image_token_id", cfg.get("image_token_index")) if is_vision_config(cfg) else None
    text = text_config({**cfg, "model_type": model_type})
    family = FAMILIES[text["model_type"]]
    return ModelArgs(**{**common_fields(text), **family.fields(text)}, image_token_id=image_token,
                     images_bidirectional=image_token is not None and model_type in BIDIRECTIONAL_IMAGE_TYPES)


def read_args_dir(model_dir: Path) -> ModelArgs:
    return read_args(read_config(model_dir / "config.json"))


def make_layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    """Layer `index` of the architecture, as its family builds it."""
    return family_of(args).layer(args, index, tp_size, reduce)
