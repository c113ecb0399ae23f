"""Load one slice and one tensor-parallel shard of a Hugging Face checkpoint, reading only the bytes it owns.

safetensors files are memory-mapped and sliced per tensor, so a pipeline stage holding layers 8-15 never
reads layers 0-7, and a tensor-parallel rank reads only its rows or columns of each split weight.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelArgs, parse_dtype
from .layers import AllReduce
from .model import ModelSlice, tp_split_dim

_INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: Path,
    *,
    start_layer: int = 0,
    end_layer: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    all_reduce: AllReduce | None = None,
    dtype: str | torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> ModelSlice:
    """Build the slice and fill it with its weights, in the config's dtype unless dtype overrides it."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if "quantization" in config or "quantization_config" in config:
        raise ValueError(f"{model_dir.name} holds quantized weights, which the torch engine cannot run")
    args = ModelArgs.from_config(config)
    if dtype is not None:
        args = dataclasses.replace(args, dtype=parse_dtype(dtype))
    model = ModelSlice(
        args, start_layer=start_layer, end_layer=end_layer,
        tp_rank=tp_rank, tp_size=tp_size, all_reduce=all_reduce, device=device,
    )
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tensors = _read_tensors(model_dir, expected, args, tp_rank, tp_size, torch.device(device))
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _checkpoint_name(param: str, args: ModelArgs, available: set[str]) -> str:
    """The checkpoint tensor behind a parameter; a tied lm_head reads the embedding."""
    if param == "lm_head.weight":
        if "lm_head.weight" in available or not args.tie_word_embeddings:
            return param
        return "model.embed_tokens.weight"
    return f"model.{param}"


def _read_tensors(
    model_dir: Path,
    expected: dict[str, tuple[int, ...]],
    args: ModelArgs,
    tp_rank: int,
    tp_size: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    files = _weight_files(model_dir)
    by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    available = set(files)
    for param in expected:
        source = _checkpoint_name(param, args, available)
        if source not in files:
            raise ValueError(f"{model_dir.name}: checkpoint has no tensor {source}")
        by_file[files[source]].append((param, source))
    loaded: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for param, source in names:
                tensor = _shard(f.get_slice(source), tp_split_dim(param), tp_rank, tp_size)
                if tuple(tensor.shape) != expected[param]:
                    raise ValueError(f"{source}: shape {tuple(tensor.shape)}, expected {expected[param]}")
                loaded[param] = tensor.to(device=device, dtype=args.dtype)
    return loaded


def _shard(view: object, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """Read a whole tensor, or this rank's contiguous block along dim, from a lazy safetensors slice."""
    shape = view.get_shape()  # type: ignore[attr-defined]
    if dim is None or size == 1:
        return view[:]  # type: ignore[index]
    block = shape[dim] // size
    index = [slice(None)] * len(shape)
    index[dim] = slice(rank * block, (rank + 1) * block)
    return view[tuple(index)]  # type: ignore[index]


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it, from the index when the checkpoint is sharded."""
    index = model_dir / _INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files: dict[str, Path] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files

