"""Keys and values stored in 8 or 4 bits (a placement's kv_cache_bits): more context in the same memory, at a
measured cost in quality (bench/quality.py's KV rows).

int8: symmetric, one float16 scale per position and head (amax / 127). int4: symmetric, one float16 scale per
group of kv_pools.int4_group(head_dim) elements of a position's head (amax / 7), two values a byte (the element at
an even index in the low nibble, stored as q + 8). Both round to nearest, so a value's error is at most half its
scale: |x - dequantize(quantize(x))| <= amax / 254 (int8) or amax / 14 (int4) of its token-head or group.

Pure tensor functions: cache.QuantizedLayerCache stores through them and dequantizes a step's gathered blocks once
per layer.
"""

from __future__ import annotations

import torch

from skulk.engines.kv_pools import int4_group

_LEVELS = {8: 127, 4: 7}
_TINY = 2.0**-24
"""The least scale (float16's smallest subnormal): an all-zero head stores zeros, never 0/0."""


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes a position of one head's keys (or values) holds at `bits`, scales apart."""
    return head_dim if bits == 8 else head_dim // 2


def scale_groups(head_dim: int, bits: int) -> int:
    """Scales a position of one head holds at `bits`."""
    return 1 if bits == 8 else head_dim // int4_group(head_dim)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as (data [..., packed_width], float16 scales [..., scale_groups]): int8 values at 8 bits, uint8
    bytes of two int4 values at 4."""
    dim = x.shape[-1]
    groups = scale_groups(dim, bits)
    levels = _LEVELS[bits]
    grouped = x.float().reshape(*x.shape[:-1], groups, dim // groups)
    scale = (grouped.abs().amax(-1, keepdim=True) / levels).clamp_min(_TINY).half()
    q = torch.round(grouped / scale.float()).clamp_(-levels, levels).reshape(x.shape)
    scales = scale.squeeze(-1)
    if bits == 8:
        return q.to(torch.int8), scales
    nibbles = (q + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """quantize's inverse in `dtype`: [..., D] from data [..., packed_width] and scales [..., scale_groups]."""
    if bits == 8:
        return data.to(dtype) * scales.to(dtype)
    low, high = data & 15, data >> 4
    q = torch.stack((low, high), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2).to(dtype) - 8
    groups = scales.shape[-1]
    return (q.reshape(*q.shape[:-1], groups, -1) * scales.to(dtype).unsqueeze(-1)).reshape(q.shape)
