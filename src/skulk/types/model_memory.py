"""A model's memory as placement counts it, layer by layer: what each decoder layer keeps per token or per stream,
and the bytes of its weights as a rank loads them (issue 40: every family, not a Llama shape).

A Llama-shaped model is one row repeated; the families people pool machines for are not. DeepSeek V3 keeps one
compressed latent per token per layer (MLA) and puts three dense layers before 58 mixture-of-experts ones; gpt-oss
alternates 128-token sliding windows with full attention; Llama 4 bounds three layers in four by an attention
chunk; Qwen3-Next and Nemotron-H keep a constant recurrent state per stream in most layers; DeepSeek and GLM ship
multi-token-prediction layers in their files that no rank runs. models/memory_math.py fills these from config.json
(or from the checkpoint's real tensor bytes), master/shard_plan.py sums them over each rank's layers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import CamelModel

LayerKind = Literal["full", "nope", "sliding", "chunked", "mla", "linear", "ssm", "mlp"]
"""How a decoder layer keeps its past:
- full: every position's keys and values (grouped-query or multi-query attention);
- nope: the same, in a layer without positional encoding (Llama 4's global layers, every fourth);
- sliding: only the last `window` positions a stream has (Gemma 3's local layers, gpt-oss' alternate ones);
- chunked: only the positions of the stream's current attention chunk (Llama 4's other layers), at most `window`;
- mla: one compressed latent per position, shared by every head (kv_lora_rank + qk_rope_head_dim elements), as
  MLX and the torch engine's native MLA keep it;
- linear / ssm: a constant state per stream whatever its length (gated DeltaNet, Mamba 2);
- mlp: nothing (Nemotron-H's feed-forward-only layers)."""
WeightsSource = Literal["config", "tensors"]
"""Where the weight bytes came from: arithmetic over config.json's dimensions and quantization, or the
checkpoint's own tensors (safetensors headers)."""


class LayerMemory(CamelModel):
    """One decoder layer: its cache per token (or per stream) and its weights."""

    kind: LayerKind
    kv_heads: int = 0
    """Key heads cached per position (values mirror them); 1 for MLA's latent; 0 for a layer with no KV."""
    head_dim: int = 0
    """Elements per cached head and position (MLA: kv_lora_rank + qk_rope_head_dim)."""
    torch_kv_heads: int = Field(default=0, exclude_if=lambda v: v == 0)  # left out at 0: older releases forbid it
    torch_head_dim: int = Field(default=0, exclude_if=lambda v: v == 0)
    """What the torch engine caches here instead, where it differs (0: kv_heads and head_dim). No layer differs
    now: its native MLA (engines/torch/models/deepseek_v3.py) caches the latent too; cards of releases that
    expanded MLA's heads there may still carry it."""
    window: int | None = None
    """Sliding window or attention chunk: the most positions a stream keeps in this layer (None: all of them)."""
    state_bytes: int = 0
    """Linear attention / SSM: the recurrent and convolution state one stream keeps, whatever its length."""
    torch_state_bytes: int = Field(default=0, exclude_if=lambda v: v == 0)
    """What the torch engine holds a stream here instead, where it differs (0: state_bytes): its gated DeltaNet
    keeps two slots a stream, the recurrent matrices in float32 (models/memory_math.torch_state_bytes)."""
    weight_bytes: int = 0
    """This layer's weights as a rank loads them (every expert resident, routed and shared)."""

    @property
    def latent(self) -> bool:
        """MLA: one vector per position (no separate values), whole on every tensor rank."""
        return self.kind == "mla"


class ModelMemory(CamelModel):
    """Every decoder layer in order, and the weights outside them."""

    layers: list[LayerMemory]
    embed_bytes: int
    """The token embedding, loaded by the first rank."""
    head_bytes: int
    """The lm_head and final norm, loaded by the last rank; a tied head is the embedding's bytes again (a last
    rank that is not the first loads its own copy)."""
    tied_bytes: int = 0
    """A tied head's table (the embedding's bytes, counted in head_bytes too): a single rank holding both the
    embedding and the head loads it once."""
    unrun_bytes: int = 0
    """Weights in the checkpoint's files that no rank runs or loads: DeepSeek V3's and GLM-4.5's
    multi-token-prediction layers (num_nextn_predict_layers), Qwen3-Next's and Qwen3.5's mtp. block (mlx-lm and
    transformers drop them when loading, the engines run no speculative head from them). Part of the download,
    never of a rank's memory."""
    source: WeightsSource = "config"

    @property
    def layer_total(self) -> int:
        return sum(layer.weight_bytes for layer in self.layers)

    def rank_weight_bytes(self, start: int, end: int) -> int:
        """The weights a rank holding decoder layers [start, end) loads: its layers, the embedding on the first
        rank, the head on the last (once when a single rank holds a tied pair)."""
        total = sum(layer.weight_bytes for layer in self.layers[start:end])
        if start == 0:
            total += self.embed_bytes
        if end == len(self.layers):
            total += self.head_bytes - (self.tied_bytes if start == 0 else 0)
        return total

    @property
    def loaded_bytes(self) -> int:
        """The whole model on one rank."""
        return self.rank_weight_bytes(0, len(self.layers))
