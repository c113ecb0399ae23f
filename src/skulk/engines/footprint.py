"""What a torch runner holds in memory once it has loaded its shard: the shard's bytes at the format it runs in,
read from the checkpoint's safetensors headers, and a fixed runtime overhead (issue 41: each rank holds its
share and no more). Imports no torch, so placement and previews can read it.

Measured with bench/memory.py (real runner processes, psutil RSS after the instance is ready).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from skulk.formats.checkpoint import DTYPE_BYTES, safetensors_header

RUNTIME_OVERHEAD_BYTES = 576 * 1024**2
"""A torch runner's resident memory besides its weights: the interpreter, torch and its libraries, our kernels,
the tokenizer, the runner's machinery, warm-up's activations and a small KV pool's touched pages. Measured with
bench/memory.py on the 2-core x86 VM (one thread per runner): 362-482 MiB for runners of the demo model (1.3 MiB
of weights) and 457-482 MiB beside the 100M bench model's shards (RSS less shard), bf16 and int4 at load; the
largest plus a fifth, for other machines' libraries and thread counts."""
SHARD_SLACK = 1.05
"""A rank's resident memory after load is at most SHARD_SLACK x its shard's bytes + RUNTIME_OVERHEAD_BYTES."""

_FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_NORM = re.compile(r"norm\.weight$")
_QUANT_BITS = {"int4": 4, "int8": 8}
_GROUP = 64
_BLOCK_ROWS = 8


def resident_bound(shard: int) -> int:
    """The most a runner holding `shard` bytes of weights may hold resident once loaded."""
    return int(SHARD_SLACK * shard) + RUNTIME_OVERHEAD_BYTES


def planned_base(share: int, runtime: int | None, exact: bool) -> int:
    """What placement counts for a rank before its KV pool: its weights and its runtime. Exact weights (the card's
    per-layer bytes, read into buffers that are kept as they are) count as they are; an estimate (the files' bytes
    in proportion to layers) with SHARD_SLACK. The runtime is the node's measured figure (types/node_info.
    RunnerOverhead), else RUNTIME_OVERHEAD_BYTES, the ceiling measured here."""
    weights = share if exact else int(SHARD_SLACK * share)
    return weights + (RUNTIME_OVERHEAD_BYTES if runtime is None else runtime)


def checkpoint_tensors(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every safetensors tensor of the checkpoint: name → (dtype, shape), from the headers alone."""
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, entry in safetensors_header(path).items():
            if name != "__metadata__":
                found[name] = (entry["dtype"], tuple(entry["shape"]))
    return found


def shard_bytes(model_dir: Path, start_layer: int, end_layer: int, quantize: str | None = None) -> int:
    """The bytes of weights a dense Llama-family rank owning layers [start_layer, end_layer) holds: its layers'
    tensors, the embedding on the first rank, the final norm and lm_head (the embedding's again when tied) on the
    last; in the config's dtype, or with every projection quantized at load as the CPU kernels lay it out
    (bits/8 per value, rows padded to 8, an f16 scale and bias per group of 64) and the rest in bfloat16."""
    config = json.loads((model_dir / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    run_bytes = 2 if quantize else _FLOAT_BYTES.get(str(config.get("torch_dtype", "float32")), 4)
    tensors = checkpoint_tensors(model_dir)
    if end_layer == layers and "lm_head.weight" not in tensors and (quantize or start_layer > 0):  # tied
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    total = 0
    for name, (dtype, shape) in tensors.items():
        if not _owned(name, start_layer, end_layer, layers):
            continue
        if quantize and len(shape) == 2 and "embed_tokens" not in name and not name.endswith("mlp.gate.weight"):
            total += _quantized_bytes(shape, _QUANT_BITS[quantize])
        else:
            total += math.prod(shape) * (run_bytes if dtype in ("F32", "F16", "BF16") else DTYPE_BYTES[dtype])
    return total


def _owned(name: str, start: int, end: int, layers: int) -> bool:
    if name.startswith("mtp."):  # Qwen3-Next's and Qwen3.5's multi-token-prediction block: never loaded
        return False
    if match := _LAYER.search(name):
        return start <= int(match.group(1)) < end
    if "embed_tokens" in name:
        return start == 0
    return end == layers and (name.startswith("lm_head") or bool(_NORM.search(name)))


def _quantized_bytes(shape: tuple[int, ...], bits: int) -> int:
    rows, columns = shape
    rows += -rows % _BLOCK_ROWS
    return rows * columns * bits // 8 + 2 * rows * (columns // _GROUP) * 2
