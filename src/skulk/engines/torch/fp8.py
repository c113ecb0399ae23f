"""FP8 block-scaled weights, as DeepSeek V3 and Kimi K2 ship them: config.json's quantization_config says
{"quant_method": "fp8", "weight_block_size": [128, 128], ...}, and each quantized Linear's `<name>.weight` is
float8_e4m3fn [out, in] beside `<name>.weight_scale_inv`, float32 [ceil(out / 128), ceil(in / 128)]: one
multiplier per 128 x 128 block (w = weight * scale_inv; the last row and column of blocks may be partial).
Embeddings, norms, routers and the head stay in the checkpoint's float dtype.

The torch engine holds them on its own weight-only kernels (quant.py) at 8 bits: each FP8 weight is dequantized
in float32 a band of rows at a time (dequantize_rows) and each band at once quantized to MLX-style affine groups
of footprint.fp8_group columns (128 for DeepSeek's blocks: one group never spans two blocks' scales), so a
runner holds about the file's bytes (a value's byte, an f16 scale and bias per 128 values: ~3% over the file's
float32 scale per 16384) and the model never exists whole in float (loader._quantized_float_linear). What the
file stores in float stays in the model's dtype, and so does MLA's kv_b_proj (footprint.FP8_FLOAT_KEPT: decode
absorbs its float weight), dequantized whole. A quantize-at-load setting (int4) wins: the FP8 weights are then
quantized to it the same way, band by band. models/memory_math.torch_dequantized_growth cards what the runner
holds beyond the files. Running the FP8 values on FP8 kernels of their own is left for later. A per-tensor FP8
layout (no weight_block_size) is not this one and is not read.
"""

from __future__ import annotations

from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
"""`<name>.weight` + this names the block scales of a weight."""
ROWS_AT_ONCE = 1 << 20
"""Values dequantized at a time: the float32 temporaries stay a few MiB whatever the matrix."""


def block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """(rows, columns) a scale covers, where the config declares block-scaled FP8 weights; None otherwise."""
    section = config.get("quantization_config") or {}
    block = section.get("weight_block_size") if section.get("quant_method") == "fp8" else None
    if not block:
        return None
    if len(block) != 2 or int(block[0]) <= 0 or int(block[1]) <= 0:
        raise ValueError(f"unsupported FP8 weight_block_size {block!r}; expected [rows, columns]")
    return int(block[0]), int(block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [out, in] (float8) times its block's scale_inv ([ceil(out / rows), ceil(in / columns)]), computed in
    float32 a band of whole blocks at a time, into out (its dtype) or a new tensor of dtype."""
    check_scales(weight, scale_inv, block)
    rows, cols = weight.shape
    target = torch.empty(rows, cols, dtype=dtype) if out is None else out
    if tuple(target.shape) != (rows, cols):
        raise ValueError(f"FP8 weight {tuple(weight.shape)} read into {tuple(target.shape)}")
    band = max(1, ROWS_AT_ONCE // max(cols, 1))
    for start in range(0, rows, band):
        stop = min(rows, start + band)
        target[start:stop] = dequantize_rows(weight, scale_inv, block, start, stop)
    return target


def check_scales(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """ValueError unless weight is a matrix and scale_inv has one scale per block of it."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 weight of shape {tuple(weight.shape)}: block scales are read for matrices only")
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"FP8 weight {tuple(weight.shape)} in blocks of {block} needs scales {expected}, "
                         f"not {tuple(scale_inv.shape)}")


def dequantize_rows(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], start: int,
                    stop: int) -> torch.Tensor:
    """Rows [start, stop) of weight [out, in] (float8) times their blocks' scale_inv, in float32 (any rows: a
    band need not begin on a block's first row). Shapes as check_scales checks them."""
    cols = weight.shape[1]
    per_row = scale_inv[torch.arange(start, stop) // block[0]].float()  # [rows, column blocks]
    return weight[start:stop].float() * per_row.repeat_interleave(block[1], dim=1)[:, :cols]


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) with each block's largest magnitude at e4m3's largest, 448: the
    layout DeepSeek publishes (tests write checkpoints with it; dequantize is its inverse up to rounding)."""
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % block[1], 0, -rows % block[0]))
    blocks = padded.view(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp_min(2.0**-126)
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale
