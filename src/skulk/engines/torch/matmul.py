"""Float linears that compute on the path the CPU runs fastest for the step's shape.

On x86 CPUs without native half-precision matmul units (AVX2 machines, most AMD EPYCs), torch multiplies
f16 and bf16 matrices fast only one row at a time (a vectorised gemv); with more rows it falls back to a
generic loop that is 5-10x slower than the f32 GEMM (bench/engine.py: prefill). So weights stay stored in
their dtype (memory is what counts), a decode step of few rows runs them as they are, and a step of
FLOAT_GEMM_ROWS rows or more (prefill, a large batch) casts activations and weights to f32 for that one
GEMM: the cast reads the weight once, the GEMM then runs at f32 speed, and the result is rounded back to
the activations' dtype, as a native half GEMM (f32 accumulation) would round it. CUDA and f32 are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FLOAT_GEMM_ROWS = 16
"""Rows from which an f16/bf16 matmul on the CPU runs as an f32 GEMM. bench/engine.py on the 2-core EPYC
(1 thread): a 512-token prefill runs 4.5x (f16) and 6.6x (bf16) faster this way, but at 8 rows (8 decode
streams) the per-step cast of every weight costs more than the half GEMM saves (8 streams ÷ 1: 1.03 with
the cast, 1.40 without), so fewer rows stay on the native path."""
_HALF = (torch.float16, torch.bfloat16)


def wants_float_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when this matmul is faster in f32: half weights on the CPU, FLOAT_GEMM_ROWS rows or more."""
    return weight.dtype in _HALF and weight.device.type == "cpu" and x.numel() >= FLOAT_GEMM_ROWS * x.shape[-1]


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) with the CPU's fast path per shape."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not wants_float_gemm(input, self.weight):
            return F.linear(input, self.weight, self.bias)
        bias = self.bias.float() if self.bias is not None else None
        return F.linear(input.float(), self.weight.float(), bias).to(input.dtype)
