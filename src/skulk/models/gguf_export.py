"""A GGUF import as a bfloat16 Hugging Face safetensors checkpoint, for the MLX engine.

mlx-lm reads no GGUF blocks (our torch engine does, engines/torch/gguf_file.py), so an MLX rank asked to serve
a GGUF import loads this instead: the import's config (what transformers read from the file's metadata) and
tokenizer, every tensor dequantized by the `gguf` package, llama.cpp's q/k row permutation undone with the
loader's own `unpermute_order`, Gemma's norms back to Hugging Face's form, in bfloat16 (a 4-bit file grows
about 3.5x; the torch engine keeps its blocks). It is written once, inside the import's own directory (so a
re-import or eviction takes it along), whole and then renamed, so concurrent ranks on one node never read half.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from skulk.engines.torch.gguf_file import PERMUTED_ARCHS, hf_name, read_layout, unpermute_order
from skulk.formats.checkpoint import read_config
from skulk.models.gguf_import import GGUF_NAME
from skulk.models.shards import write_safetensors

EXPORT_DIR = "bf16-export"
"""The checkpoint's folder inside the import's directory."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
_HEADS = {"attn_q": "heads", "attn_k": "kv_heads"}


class NotExportable(ValueError):
    """The GGUF file holds something the exported checkpoint could not say to mlx-lm."""


def is_gguf_import(model_dir: Path) -> bool:
    return (model_dir / GGUF_NAME).is_file()


def float_checkpoint(model_dir: Path) -> Path:
    """model_dir itself, or for a GGUF import its bf16 export (written on first use)."""
    if not is_gguf_import(model_dir):
        return model_dir
    target = model_dir / EXPORT_DIR
    if (target / "config.json").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=model_dir))
    try:
        export_bf16(model_dir, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another rank on this node finished first: its export is the same
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def export_bf16(model_dir: Path, out: Path) -> None:
    """Write the import in model_dir as a bf16 safetensors checkpoint into the existing folder out."""
    config: dict[str, Any] = read_config(model_dir / "config.json")
    if config.get("rope_freq_factors") is not None:
        raise NotExportable("this GGUF file's Llama 3 rope scaling (rope_freqs) has no mlx-lm form here; "
                            "serve it with the torch engine")
    gguf = model_dir / GGUF_NAME
    layout = config.pop("gguf", None) or read_layout(gguf)
    config.pop("quantization", None)
    config["torch_dtype"] = "bfloat16"
    write_safetensors(bf16_tensors(gguf, layout), out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)


def bf16_tensors(gguf: Path, layout: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor the engine loads, under its Hugging Face name, as the gguf package dequantizes it, in the
    Hugging Face row order, in bfloat16. A MoE's experts stay stacked under mlx-lm's switch_mlp names."""
    arch = str(layout["arch"])
    for tensor in GGUFReader(gguf).tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
        kind = tensor.name.rpartition(".")[0].rpartition(".")[2]
        if arch in PERMUTED_ARCHS and kind in _HEADS:
            values = values[unpermute_order(values.shape[0], int(layout[_HEADS[kind]]))]
        if arch.startswith("gemma") and tensor.name.endswith("norm.weight"):
            values = values - 1  # llama.cpp stores Gemma's norms as weight + 1
        yield name, values.to(torch.bfloat16).contiguous()
