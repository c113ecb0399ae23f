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
BLOCK_ROWS = 8
"""The CPU kernels read weights in blocks of 8 output rows; a matrix's rows are zero-padded to a multiple of it."""
SUPPORTED_GROUPS = (32, 64, 128, 256)
"""The quantization groups the torch engine's weight-only kernels take (engines/torch/quant.py)."""
FP8_FLOAT_KEPT = ("kv_b_proj",)
"""Projections an FP8 checkpoint's load leaves in float (dequantized) rather than at 8 bits: MLA's kv_b_proj, whose
float weight a decode step absorbs into the queries (models/deepseek_v3.py); quantized, every step would expand
the whole cached context through it. DeepSeek V3's are 0.15% of its weights."""


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
    return quantized_bytes(shape[0], shape[1], bits, _GROUP)


def quantized_bytes(rows: int, columns: int, bits: int, group: int) -> int:
    """A matrix as the CPU kernels hold it quantized (quant.interleave8): rows padded to BLOCK_ROWS, bits/8 bytes a
    value, an f16 scale and an f16 bias per group of `group` columns."""
    rows += -rows % BLOCK_ROWS
    return rows * columns * bits // 8 + 2 * rows * (columns // group) * 2


def fitting_group(columns: int, preferred: int) -> int | None:
    """The group size to quantize a float matrix with: the preferred one when it divides the columns, else
    the largest supported one that does (None: none does, and the matrix stays float)."""
    if columns % preferred == 0:
        return preferred
    return next((g for g in sorted(SUPPORTED_GROUPS, reverse=True) if columns % g == 0), None)


def fp8_group(block_columns: int) -> int:
    """The group an FP8 block-scaled checkpoint's weights are held in at 8 bits: the largest supported group that
    divides the FP8 block's width (DeepSeek's 128 x 128 blocks: 128). Every group then lies inside one FP8 block,
    so its values share one FP8 scale and 8-bit steps of (max - min) / 255 over it lose little of e4m3's 3-bit
    mantissa; a wider group (256) would span two blocks' scales, and narrower ones (32, 64) cost two or four times
    the scale and bias bytes (4 per group: 3% of a value's byte at 128) for no precision the FP8 values hold. A
    block no supported group divides takes 128, what DeepSeek's would."""
    return max((g for g in SUPPORTED_GROUPS if block_columns % g == 0), default=128)
