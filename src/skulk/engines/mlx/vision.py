"""Images into mlx-lm's Gemma 3 language model: the tower's embeddings put in place of the image placeholders, and
the image tokens let to attend to each other both ways.

Why not mlx-vlm: its package requires datasets, opencv-python, mlx-audio, miniaudio, llguidance and a web server
stack (a dependency cannot be declared without them), its models run on its own caches rather than mlx-lm's that
this engine batches, slices for a Pipeline and shards, and its Gemma 3 attends causally within an image, where
transformers' (the reference) attends both ways. So the tower is the torch engine's (engines/torch/vision.py:
transformers' SigLIP and projector, run on rank 0 before the request is added, as there), and the language model
stays mlx-lm's, which takes `input_embeddings` and builds its masks through each cache's `make_mask`.

Every rank finds the images' runs in the prompt itself (vision.image_spans) and widens the masks of a chunk that
holds one (image_masks); only rank 0, which embeds the prompt, needs the embeddings (image_embeddings): a later
Pipeline rank receives hidden states.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from skulk.engines.torch.vision import image_rows

VISION_FAMILIES = frozenset({"gemma3"})
"""Vision-language model types whose images this engine reads: the tower (engines/torch/vision.VisionTower) and
the scaled embedding below are Gemma 3's."""


def image_token(config: dict[str, Any]) -> int | None:
    """The placeholder token of a vision checkpoint this engine reads images for; None for any other model."""
    if config.get("model_type") not in VISION_FAMILIES or not config.get("vision_config"):
        return None
    found = config.get("image_token_id", config.get("image_token_index"))
    return int(found) if found is not None else None


def to_mlx(embeds: torch.Tensor) -> mx.array:
    """The tower's [tokens, hidden] output as an MLX array (float32: numpy has no bfloat16)."""
    return mx.array(embeds.detach().to(torch.float32).numpy())


def image_embeddings(inner: Any, ids: mx.array, spans: Sequence[tuple[int, int]], start: int,
                     embeds: mx.array) -> mx.array:
    """[1, chunk, hidden]: the chunk's token embeddings with its image rows replaced by the tower's, divided by
    the scale mlx-lm's Gemma 3 multiplies its input by (transformers scales the text embeddings only)."""
    h = inner.embed_tokens(ids)
    offsets, index = image_rows(spans, start, start + ids.shape[1])
    if offsets:
        scale = mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        h[0, mx.array(offsets)] = (embeds[mx.array(index)] / scale).astype(h.dtype)
    return h


def _block(spans: Sequence[tuple[int, int]], start: int, queries: int, keys: int) -> mx.array | None:
    """[queries, keys]: True where a query of the chunk at `start` and a key are tokens of one image. The keys
    are the last `keys` positions up to the chunk's end (a sliding layer's rotating cache keeps only its window)."""
    end = start + queries
    q = np.arange(start, end)[:, None]
    k = np.arange(end - keys, end)[None, :]
    found: Any = None
    for s, e in spans:
        if s < end and e > start:
            both = (q >= s) & (q < e) & (k >= s) & (k < e)
            found = both if found is None else found | both
    return None if found is None else mx.array(found)


@contextmanager
def image_masks(cache: Sequence[Any], spans: Sequence[tuple[int, int]], start: int) -> Iterator[None]:
    """While a chunk starting at `start` runs: each cache's mask (the one mlx-lm's model asks it for) also lets an
    image's tokens see each other, as transformers' Gemma 3 does (its token_type_ids mask)."""
    patched = []
    for layer in cache:
        if hasattr(layer, "make_mask"):
            layer.make_mask = _widened(layer.make_mask, spans, start)
            patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            del layer.make_mask  # the class's own again


def _widened(make_mask: Any, spans: Sequence[tuple[int, int]], start: int) -> Any:
    def make(n: int, *args: Any, return_array: bool = False, **kwargs: Any) -> Any:
        mask = make_mask(n, *args, return_array=True, **kwargs)
        if mask is None:
            return None
        block = _block(spans, start, n, mask.shape[-1])
        return mask if block is None else mask | block

    return make
