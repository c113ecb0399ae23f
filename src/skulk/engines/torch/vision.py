"""A vision-language model's images, turned into what our language model reads: placeholder tokens in the prompt
and, for them, the vision tower's embeddings.

The tower and its projector are transformers' own implementation (Gemma 3: SigLIP and Gemma3MultiModalProjector;
Qwen2.5-VL: its windowed-attention ViT with the patch merger), loaded from the checkpoint's own weights beside our
language model. They run on rank 0 only, in its runner, before the request is added: rank 0 embeds the prompt, so
it alone needs the image embeddings, and every later rank of a Pipeline receives hidden states as for any prompt.
Every rank finds the images' positions in the prompt itself (runs of the image token), because Gemma 3 lets an
image's tokens attend to each other both ways (image_spans; cache.StepBatch's mask) and Qwen2.5-VL rotates them by
their place in the image's grid (mrope.py: the grids travel with the request), the same on every rank.

A request with images neither shares nor publishes cached blocks (scheduler.py): two different images have the
same placeholder tokens, so a block keyed by its tokens could hand one image's keys and values to another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from skulk.engines.errors import PromptRejected
from skulk.formats.images import ImageRefused, image_bytes, open_image
from skulk.types.chat import ChatMessage

from .config import is_vision_config
from .mrope import Grid

_PREFIXES = {"vision_tower.": ("model.vision_tower.", "vision_tower."),
             "multi_modal_projector.": ("model.multi_modal_projector.", "multi_modal_projector.")}
_QWEN_PREFIXES = {"visual.": ("model.visual.", "visual.")}
"""Where each family keeps its tower's tensors: the published layout's prefix, or transformers 5's (model.)."""


@dataclass(frozen=True)
class VisionInput:
    """One request's images as the language model reads them: an embedding per placeholder token, in prompt order
    ([tokens, hidden], the model's dtype), a digest of the images (what tells two image prompts apart), and where
    the model's rope reads them, each image's grid of merged patches (mrope.Grid; () for Gemma 3)."""

    embeds: torch.Tensor
    digest: str
    grids: tuple[Grid, ...] = ()


def image_spans(prompt: Sequence[int], image_token: int | None) -> tuple[tuple[int, int], ...]:
    """The [start, end) runs of the image token in a prompt: one per image."""
    if image_token is None:
        return ()
    spans, start = [], None
    for i, token in enumerate(prompt):
        if token == image_token and start is None:
            start = i
        elif token != image_token and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(prompt)))
    return tuple(spans)


def whole_images(spans: Sequence[tuple[int, int]], start: int, take: int) -> int:
    """A prefill chunk's share of a prompt, shortened so it does not end inside an image that starts after the
    chunk does (its tokens attend to each other both ways, so they are computed in one chunk). An image that starts
    at the chunk's start gets a chunk of its length (image_chunk); one longer than the engine's prefill_chunk, or
    whose share goes partly to an earlier prompt, is split rather than stall the scheduler."""
    end = start + take
    for s, e in spans:
        if start < s < end < e:
            return s - start
    return take


def image_chunk(chunk: int, spans: Sequence[tuple[int, int]], length: int, cap: int) -> int:
    """The step's chunk, raised (up to cap, the engine's prefill_chunk) to the length of an image the first prompt
    being prefilled starts with at `length`: a short chunk riding on decode steps would otherwise split it."""
    span = next(((s, e) for s, e in spans if s == length), None)
    return max(chunk, min(span[1] - span[0], cap)) if span else chunk


def image_rows(spans: Sequence[tuple[int, int]], start: int, end: int) -> tuple[list[int], list[int]]:
    """For the prompt positions [start, end): the offsets (from start) of its image positions, and the index of
    each one's embedding among the prompt's (images in order, each's tokens in order)."""
    offsets, index, before = [], [], 0
    for s, e in spans:
        for p in range(max(s, start), min(e, end)):
            offsets.append(p - start)
            index.append(before + p - s)
        before += e - s
    return offsets, index


def image_mask(spans: Sequence[tuple[int, int]], start: int, end: int,
               device: torch.device) -> torch.Tensor | None:
    """[1, 1, end - start, end]: True where a chunk's query and key are tokens of one image (Gemma 3 attends
    within an image both ways; transformers' token_type_ids mask); None when the chunk holds no image."""
    queries = torch.arange(start, end, device=device).view(-1, 1)
    keys = torch.arange(end, device=device).view(1, -1)
    mask = None
    for s, e in spans:
        if s < end and e > start:
            both = (queries >= s) & (queries < e) & (keys >= s) & (keys < e)
            mask = both if mask is None else mask | both
    return None if mask is None else mask.view(1, 1, end - start, end)


class VisionTower:
    """Gemma 3's SigLIP tower, projector and image processor (how a prompt's image marker expands is the
    tokenizer's: tokenizer.ChatTokenizer.image_run)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        config: Any = AutoConfig.from_pretrained(model_dir)
        self.config, self.dtype, self.device = config, dtype, device
        self.tower = AutoModel.from_config(config.vision_config)
        self.projector = Gemma3MultiModalProjector(config)
        weights = _weights(model_dir)
        self.tower.load_state_dict(weights["vision_tower."])
        self.projector.load_state_dict(weights["multi_modal_projector."])
        self.tower.to(device=device, dtype=dtype).eval()
        self.projector.to(device=device, dtype=dtype).eval()
        self.processor: Any = AutoImageProcessor.from_pretrained(model_dir)

    def encode(self, images: Sequence[Any]) -> tuple[torch.Tensor, tuple[Grid, ...]]:
        """[tokens, hidden] every image's embeddings, in order; Gemma 3's rope reads no grids."""
        return self.embed(images), ()

    def embed(self, images: Sequence[Any]) -> torch.Tensor:
        """[tokens, hidden]: every image's projected tower output, in order."""
        return self.project(self.pixels(images))

    def pixels(self, images: Sequence[Any]) -> torch.Tensor:
        """The image processor's resized and normalised pixels of every image."""
        return self.processor(images=list(images), return_tensors="pt")["pixel_values"]

    @torch.inference_mode()
    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower and projector over `pixels`: [tokens, hidden]."""
        hidden = self.tower(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
        return self.projector(hidden).reshape(-1, self.config.text_config.hidden_size).to(self.dtype)


class QwenVisionTower:
    """Qwen2.5-VL's vision transformer (patch embedding, windowed and full attention blocks, the 2x2 patch merger)
    and image processor (resize to a multiple of patch x merge within min/max pixels, then patches)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoConfig, AutoImageProcessor
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        config: Any = AutoConfig.from_pretrained(model_dir)
        self.dtype, self.device = dtype, device
        self.merge = int(config.vision_config.spatial_merge_size)
        self.tower: Any = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)
        self.tower.load_state_dict(_weights(model_dir, _QWEN_PREFIXES)["visual."])
        self.tower.to(device=device, dtype=dtype).eval()
        self.processor: Any = AutoImageProcessor.from_pretrained(model_dir)

    def encode(self, images: Sequence[Any]) -> tuple[torch.Tensor, tuple[Grid, ...]]:
        """[tokens, hidden] every image's merged-patch embeddings, in order, and each image's grid of them."""
        out = self.processor(images=list(images), return_tensors="pt")
        grid = out["image_grid_thw"]
        with torch.inference_mode():
            embeds = self.tower(out["pixel_values"].to(self.device, self.dtype), grid_thw=grid).pooler_output
        grids = tuple((int(t), int(h) // self.merge, int(w) // self.merge) for t, h, w in grid.tolist())
        return embeds.to(self.dtype), grids


Tower = VisionTower | QwenVisionTower


def digest(images: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for data in images:
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def read_images(tower: Tower, messages: Sequence[ChatMessage]) -> VisionInput:
    """A request's images, in order, read (formats/images.py: data URLs, or files under the admin's directory)
    and through `tower`: what an engine's encode_images hands its add_request. PromptRejected for an image that
    cannot be read."""
    try:
        data = [image_bytes(url) for message in messages for url in message.images]
        images = [open_image(d) for d in data]
    except ImageRefused as exc:
        raise PromptRejected(str(exc)) from exc
    embeds, grids = tower.encode(images)
    return VisionInput(embeds, digest(data), grids)


def load_tower(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Tower | None:
    """The checkpoint's vision tower, or None for a text-only model."""
    config = json.loads((model_dir / "config.json").read_text())
    if not is_vision_config(config):
        return None
    tower = QwenVisionTower if config.get("model_type") == "qwen2_5_vl" else VisionTower
    return tower(model_dir, dtype, device)


def _weights(model_dir: Path, modules: dict[str, tuple[str, ...]] = _PREFIXES) -> dict[str, dict[str, torch.Tensor]]:
    """The tower's (and projector's) tensors, by module, named as the module names them (either layout's prefix)."""
    found: dict[str, dict[str, torch.Tensor]] = {module: {} for module in modules}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                for module, prefixes in modules.items():
                    prefix = next((p for p in prefixes if key.startswith(p)), None)
                    if prefix is not None:
                        found[module][key[len(prefix):]] = f.get_tensor(key)
    return found
