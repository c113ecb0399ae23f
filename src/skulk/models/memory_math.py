"""A model's memory per layer (types/model_memory.ModelMemory) from config.json, or from its tensors' real bytes.

From config alone the weights are counted tensor by tensor (models/layer_shapes.py) at the layout the checkpoint
ships: float; MLX affine (mlx-community's `quantization: {group_size, bits}`, per-module overrides for mixed
precision: packed `bits` per weight plus a float scale and bias per group); MXFP4 (4-bit values and one e8m0
scale byte per 32: gpt-oss's experts as OpenAI ships them, or every Linear under mlx's `mode: mxfp4`); FP8
blocks (DeepSeek's own checkpoint: a byte a weight, a float32 scale per 128 x 128 block). Where the safetensors
headers are at hand, memory_from_tensors takes each layer's bytes from the tensors themselves.

The cache side follows each layer's kind: keys and values per position for attention, bounded by a sliding window
or an attention chunk, one latent per position for MLA, a constant state per stream for linear attention and SSMs
(and what the torch engine holds a stream where it holds more: torch_state_bytes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from skulk.engines.footprint import FP8_FLOAT_KEPT, fitting_group, fp8_group, quantized_bytes
from skulk.formats.checkpoint import safetensors_header
from skulk.models.layer_shapes import (
    Tensor,
    head_dim,
    layer_kinds,
    layer_tensors,
    moe_layers,
    mtp_tensors,
    text_of,
)
from skulk.types.model_memory import LayerKind, LayerMemory, ModelMemory

FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MXFP4_BLOCK = 32
"""MXFP4: one shared e8m0 exponent byte per 32 four-bit values (OCP microscaling)."""
_NOT_FP8 = ("model.embed_tokens.", "lm_head.", ".mlp.gate.")
"""What DeepSeek's FP8 checkpoint leaves in float, as prefixes of a path + "." (the router, not mlp.gate_proj)."""
_LAYER = re.compile(r"^(?:(?:model|language_model|backbone)\.)*layers\.(\d+)\.")
MTP_PREFIX = "mtp."
"""Where Qwen3-Next's and Qwen3.5's files keep their multi-token-prediction block, which no rank loads."""
_FINAL_NORM = re.compile(r"^(?:(?:model|language_model|backbone)\.)*(?:norm|norm_f|final_layernorm)\.")


@dataclass(frozen=True)
class Layout:
    """How the checkpoint stores its weights."""

    kind: Literal["float", "affine", "mxfp4", "fp8"] = "float"
    bits: int = 16
    group: int = 64
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """mlx-community's per-module settings: {bits, group_size} for that module, or false (left in float)."""
    experts_only: bool = False
    """OpenAI's gpt-oss checkpoint: only the routed experts are MXFP4, the rest bfloat16."""
    block: tuple[int, int] = (128, 128)


def layout_of(config: dict[str, Any]) -> Layout:
    """The layout config.json declares (mlx's `quantization`, or Hugging Face's `quantization_config`)."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    method = str(q.get("quant_method") or q.get("mode") or "")
    if method == "mxfp4":
        return Layout("mxfp4", 4, MXFP4_BLOCK, experts_only="quant_method" in q)
    if method == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        return Layout("fp8", 8, block=(int(block[0]), int(block[1])))
    if q.get("bits") and q.get("group_size"):
        overrides = {k: v for k, v in q.items() if isinstance(v, dict | bool)}
        return Layout("affine", int(q["bits"]), int(q["group_size"]), overrides)
    return Layout()


def float_bytes(config: dict[str, Any]) -> int:
    return FLOAT_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), 2)


def tensor_bytes(t: Tensor, layout: Layout, fb: int) -> int:
    """One tensor's bytes in the layout (a tensor the layout does not pack stays at fb bytes a value)."""
    n = math.prod(t.shape)
    if not t.quantizable or layout.kind == "float":
        return n * fb
    if layout.kind == "fp8":
        if not _fp8_stored(t):
            return n * fb
        *stack, rows, cols = t.shape
        blocks = math.prod(stack) * -(-rows // layout.block[0]) * -(-cols // layout.block[1])
        return n + 4 * blocks
    if layout.kind == "mxfp4":
        if layout.experts_only and not t.expert:
            return n * fb
        return n // 2 + n // MXFP4_BLOCK
    bits, group = layout.bits, layout.group
    override = layout.overrides.get(t.path)
    if override is False:
        return n * fb
    if isinstance(override, dict):
        bits, group = int(override.get("bits", bits)), int(override.get("group_size", group))
    if t.shape[-1] % group:
        return n * fb  # mlx-lm leaves a weight whose rows do not divide into groups unquantized
    return n * bits // 8 + 2 * (n // group) * fb  # packed values, a scale and a bias per group


def _fp8_stored(t: Tensor) -> bool:
    """Whether DeepSeek's FP8 checkpoint stores the tensor as FP8 blocks (its projections, not _NOT_FP8)."""
    return t.quantizable and not any(mark in f"{t.path}." for mark in _NOT_FP8)


TORCH_STATE_SLOTS = 2
"""Slots a stream holds in each of the torch engine's gated DeltaNet layers (engines/torch/models/qwen3_next.py,
StreamStates): the state a step read and the one it wrote, so a step the engine drops leaves the read one intact."""


def _delta_net(c: dict[str, Any]) -> tuple[int, int]:
    """Gated DeltaNet's elements per stream: the recurrent value-heads x key-dim x value-dim matrices, and the
    convolution's last kernel-1 inputs of q, k and v."""
    kh, kd = int(c["linear_num_key_heads"]), int(c["linear_key_head_dim"])
    vh, vd = int(c["linear_num_value_heads"]), int(c["linear_value_head_dim"])
    return vh * kd * vd, (int(c.get("linear_conv_kernel_dim") or 4) - 1) * (2 * kh * kd + vh * vd)


def state_bytes(c: dict[str, Any], kind: LayerKind, fb: int) -> int:
    """One stream's constant state in a linear-attention or SSM layer: gated DeltaNet's recurrent matrices and
    its convolution's inputs (_delta_net); Mamba 2's heads x head-dim x state-size and its convolution's last
    kernel-1 inputs. The recurrent (SSM) part is float32 (Nemotron-H's in its mamba_ssm_cache_dtype, float32
    unless the config says otherwise), the convolution's inputs in the model's float bytes: what mlx-lm holds
    (gated_delta and ssm start from float32 zeros; measured on bf16 layers) and transformers' caches too."""
    if kind == "linear":
        recurrent, conv = _delta_net(c)
        return recurrent * FLOAT_BYTES["float32"] + conv * fb
    if kind == "ssm":
        heads, state, groups = int(c["mamba_num_heads"]), int(c["ssm_state_size"]), int(c.get("n_groups") or 1)
        inner = heads * int(c["mamba_head_dim"])
        ssm_fb = FLOAT_BYTES.get(str(c.get("mamba_ssm_cache_dtype") or ""), FLOAT_BYTES["float32"])
        conv = (int(c.get("conv_kernel") or 4) - 1) * (inner + 2 * groups * state)
        return heads * int(c["mamba_head_dim"]) * state * ssm_fb + conv * fb
    return 0


def torch_state_bytes(c: dict[str, Any], kind: LayerKind, fb: int) -> int:
    """What a stream costs the torch engine's gated DeltaNet layer: TORCH_STATE_SLOTS slots of the layer's
    state (state_bytes). 0 (the layer's state_bytes) for every other kind: Nemotron-H's Mamba runs through
    transformers' fallback."""
    return TORCH_STATE_SLOTS * state_bytes(c, kind, fb) if kind == "linear" else 0


def cache_shape(c: dict[str, Any], kind: LayerKind) -> dict[str, Any]:
    """A layer's KV fields: heads and width cached per position, and the window that bounds them."""
    if kind == "mla":  # the latent, which MLX, the torch engine's native MLA and its fallback all keep
        return {"kv_heads": 1, "head_dim": int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])}
    if kind in ("linear", "ssm", "mlp"):
        return {}
    kv = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    window = {"sliding": c.get("sliding_window"), "chunked": c.get("attention_chunk_size")}.get(kind)
    return {"kv_heads": kv, "head_dim": head_dim(c), "window": int(window) if window else None}


def _layers(c: dict[str, Any], weights: list[int]) -> list[LayerMemory]:
    fb = float_bytes(c)
    return [LayerMemory(kind=kind, state_bytes=state_bytes(c, kind, fb), weight_bytes=w,
                        torch_state_bytes=torch_state_bytes(c, kind, fb), **cache_shape(c, kind))
            for kind, w in zip(layer_kinds(c), weights, strict=True)]


def torch_dequantized_growth(config: dict[str, Any]) -> int:
    """Bytes a torch rank holds beyond the files: gpt-oss's MXFP4 experts, which the torch engine dequantizes to
    the model's float dtype while loading (engines/torch/mxfp4.py), at fb bytes a value instead of half a byte
    and a scale byte per 32; DeepSeek's block-scaled FP8 weights (engines/torch/fp8.py), held at 8 bits
    (torch_fp8_bytes: a byte a value and an f16 scale and bias per group instead of a float32 scale a block, and
    kv_b_proj in float): a few percent. 0 for anything else, or a config without the dimensions."""
    c = text_of(config)
    layout = layout_of(c)
    mxfp4 = c.get("model_type") == "gpt_oss" and layout.kind == "mxfp4"
    if not mxfp4 and layout.kind != "fp8":
        return 0
    try:
        kinds, moe, fb = layer_kinds(c), moe_layers(c), float_bytes(c)
        grown = [t for i, kind in enumerate(kinds) for t in layer_tensors(c, i, kind, i in moe)
                 if t.expert or not mxfp4]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    if layout.kind == "fp8":
        return sum(torch_fp8_bytes(t, layout, fb) - tensor_bytes(t, layout, fb) for t in grown)
    return sum(math.prod(t.shape) * fb - tensor_bytes(t, layout, fb) for t in grown)


def torch_fp8_bytes(t: Tensor, layout: Layout, fb: int) -> int:
    """What the torch engine holds of an FP8 checkpoint's tensor with no quantize-at-load asked (engines/torch/
    fp8.py): an FP8 weight at 8 bits in groups of footprint.fp8_group, as the CPU kernels lay it out
    (footprint.quantized_bytes; torch's CUDA rows hold less: a byte a value and a scale a row); in float (fb bytes
    a value) what the file stores in float, a matrix no group divides, and footprint.FP8_FLOAT_KEPT."""
    n = math.prod(t.shape)
    if not _fp8_stored(t) or t.path.rsplit(".", 1)[-1] in FP8_FLOAT_KEPT:
        return n * fb
    *stack, rows, cols = t.shape
    group = fitting_group(cols, fp8_group(layout.block[1]))
    return n * fb if group is None else math.prod(stack) * quantized_bytes(rows, cols, 8, group)


def kinds_of(config: dict[str, Any]) -> list[LayerKind] | None:
    """Each decoder layer's kind from config.json (None: the config does not say enough)."""
    try:
        return layer_kinds(text_of(config))
    except (KeyError, TypeError, ValueError):
        return None


def model_memory(config: dict[str, Any]) -> ModelMemory | None:
    """The arithmetic from config.json alone; None when it lacks the dimensions (a card then keeps placement's
    storage_size estimate)."""
    c = text_of(config)
    try:
        kinds, moe = layer_kinds(c), moe_layers(c)
        if len(kinds) != int(c["num_hidden_layers"]):
            return None
        layout, fb = layout_of(c), float_bytes(c)
        weights = [sum(tensor_bytes(t, layout, fb) for t in layer_tensors(c, i, kind, i in moe))
                   for i, kind in enumerate(kinds)]
        h, vocab = int(c["hidden_size"]), int(c["vocab_size"])
        embed = tensor_bytes(Tensor("model.embed_tokens", (vocab, h), True), layout, fb)
        tied = bool(c.get("tie_word_embeddings", False))
        head = embed if tied else tensor_bytes(Tensor("lm_head", (vocab, h), True), layout, fb)
        unrun = sum(tensor_bytes(t, layout, fb) for t in mtp_tensors(c))
        return ModelMemory(layers=_layers(c, weights), embed_bytes=embed, head_bytes=head + h * fb,
                           tied_bytes=embed if tied else 0, unrun_bytes=unrun)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def memory_from_tensors(config: dict[str, Any], sizes: Mapping[str, int]) -> ModelMemory | None:
    """The same from the checkpoint's tensors (name -> bytes, safetensors headers): each decoder layer's tensors,
    the final norm and lm_head on the last rank (the embedding's table when the checkpoint has no lm_head: tied),
    layers past num_hidden_layers and Qwen's mtp. block (layer_shapes.mtp_tensors) unrun, and everything else
    (the embedding, a vision tower, a projector) on the first rank."""
    c = text_of(config)
    try:
        n = int(c["num_hidden_layers"])
        layers, embed, head, unrun = [0] * n, 0, 0, 0
        for name, nbytes in sizes.items():
            if name.startswith(MTP_PREFIX):
                unrun += nbytes
            elif match := _LAYER.match(name):
                i = int(match.group(1))
                if i < n:
                    layers[i] += nbytes
                else:
                    unrun += nbytes
            elif name.startswith("lm_head") or _FINAL_NORM.match(name):
                head += nbytes
            else:
                embed += nbytes
        tied = not any(name.startswith("lm_head") for name in sizes)
        table = sum(b for name, b in sizes.items() if "embed_tokens" in name and not _LAYER.match(name))
        return ModelMemory(layers=_layers(c, layers), embed_bytes=embed, head_bytes=head + (table if tied else 0),
                           tied_bytes=table if tied else 0, unrun_bytes=unrun, source="tensors")
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def checkpoint_tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Every tensor's bytes in the checkpoint's safetensors files, from their (bounded, checked) headers."""
    sizes: dict[str, int] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, entry in safetensors_header(path).items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                sizes[name] = end - begin
    return sizes


FILES_TOLERANCE = 0.03
"""How far the config's arithmetic may stray from the files' bytes and still be trusted for a card."""


def card_memory(config: dict[str, Any], files_bytes: int, tensors: Mapping[str, int] | None = None
                ) -> ModelMemory | None:
    """The per-layer memory a card carries: the checkpoint's own tensor bytes where they were read (tensors:
    name -> bytes), else the config's arithmetic when it accounts for the checkpoint's bytes (loaded plus unrun
    within FILES_TOLERANCE of the files), else None and placement keeps its storage_size estimate (a layout or
    companion this arithmetic does not know, a vision tower, a GGUF import's file)."""
    if tensors:
        return memory_from_tensors(config, tensors)
    memory = model_memory(config)
    if memory is None or files_bytes <= 0:
        return None
    counted = memory.loaded_bytes + memory.unrun_bytes
    return memory if abs(counted - files_bytes) <= FILES_TOLERANCE * files_bytes else None
