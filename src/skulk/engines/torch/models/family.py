"""What a model family tells the torch engine: the model types it covers, the ModelArgs fields it reads beyond
config.common_fields, how to build its layer i, and its model-level hooks (embedding scale, final norm).

One Family per file beside this one (llama.py, gemma3.py, qwen3_moe.py, ...); the package's __init__ is the
registry that maps a config's model_type to its Family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ModelArgs
from ..layers import AllReduce

LayerBuilder = Callable[[ModelArgs, int, int, AllReduce], nn.Module]
"""(args, layer index, tensor-parallel size, all_reduce) -> the layer: its attention, MLP and norms."""


def no_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


def unscaled(h: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    return h


@dataclass(frozen=True, slots=True)
class Family:
    model_types: tuple[str, ...]
    """The config model_types this family runs (a multimodal wrapper's too, where config.text_config unwraps
    it to one of them)."""
    layer: LayerBuilder
    fields: Callable[[dict[str, Any]], dict[str, Any]] = no_fields
    """ModelArgs fields read from the language model's config beyond common_fields (they override them)."""
    scale_embeddings: Callable[[torch.Tensor, ModelArgs], torch.Tensor] = unscaled
    """The first slice's token embeddings as the decoder reads them (Gemma scales them)."""
    norm_unit_offset: bool = False
    """The final norm scales by 1 + weight (Gemma's checkpoints store it that way)."""
    stateful: bool = False
    """Some layers keep a state per stream instead of KV rows (Qwen3-Next's linear attention), keyed by the
    stream's first KV block: the engine shares no prefixes and speculates none for it, and tells the model when a
    stream's blocks go back (forget_stream)."""


def forget_stream(model: nn.Module, block: int) -> None:
    """Drop the per-stream state every layer of a stateful family's slice keeps for the stream whose first KV
    block is `block` (its request left or was preempted)."""
    for module in model.modules():
        forget = getattr(module, "forget_stream", None)
        if callable(forget):
            forget(block)
