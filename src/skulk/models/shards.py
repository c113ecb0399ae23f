"""A converted checkpoint written as safetensors: the GGUF imports' bf16 export (models/gguf_export.py) and their
dequantized checkpoints (models/gguf_moe.py) write their tensors one shard at a time through here."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 2 << 30
"""Tensors are written in files of about this size, so converting a large model never holds it all at once."""


def write_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], out: Path) -> dict[str, int]:
    """The tensors as a safetensors checkpoint in the folder out: one model.safetensors, or shards of about
    SHARD_BYTES with their index, each written as soon as it fills (a large model is never held whole).
    Returns each tensor's bytes (the card's per-layer memory counts them)."""
    sizes: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0
    files: list[list[str]] = []

    def flush() -> None:
        files.append(list(shard))
        save_file(shard, str(out / f".shard-{len(files)}.safetensors"), metadata={"format": "pt"})
        shard.clear()

    for name, values in tensors:
        shard[name] = values
        sizes[name] = values.numel() * values.element_size()
        size += sizes[name]
        if size >= SHARD_BYTES:
            flush()
            size = 0
    if shard or not files:
        flush()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(files):  # named once their count is known
        file = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(out / f".shard-{i + 1}.safetensors", out / file)
        weight_map.update(dict.fromkeys(names, file))
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sizes
