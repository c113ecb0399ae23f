"""MXFP4 weights (OCP microscaling FP4), as OpenAI ships gpt-oss's routed experts: a tensor `<name>` is stored as
`<name>_blocks` [..., out, in / 32, 16] uint8, two E2M1 values a byte (the low nibble the even column), and
`<name>_scales` [..., out, in / 32] uint8, one e8m0 exponent (bias 127) shared by each 32 values of a row.

The torch engine dequantizes them while loading (loader.py), one expert at a time, into the model's float dtype:
every MXFP4 value is exact in bfloat16 (a 2-bit mantissa times a power of two), so a bfloat16 model holds the
very weights the checkpoint encodes, at four times their packed size. Running the packed form on kernels of its
own is left for later.
"""

from __future__ import annotations

import torch

BLOCK = 32
"""Values sharing one scale."""
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1's sixteen codes (transformers' integrations/mxfp4.FP4_VALUES)."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., out, in] values in dtype from blocks [..., out, in / 32, 16] and scales [..., out, in / 32]: the
    values transformers' convert_moe_packed_tensors gives, before the transpose it makes for its own layout."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1).flatten(-2)
    exponents = scales.to(torch.int32).unsqueeze(-1) - 127
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)
