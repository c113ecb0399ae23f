"""Float linears that compute on the path the CPU runs fastest for the step's shape.

On x86 CPUs without native half-precision matmul units (AVX2 machines, most AMD EPYCs), torch multiplies
f16 and bf16 matrices fast only one row at a time (a vectorised gemv); with more rows it falls back to a
generic loop that is 5-10x slower than the f32 GEMM (bench/engine.py: prefill). So weights stay stored in
their dtype (memory is what counts), a decode step of few rows runs them as they are, and a step of
FLOAT_GEMM_ROWS rows or more (prefill, a large batch) casts activations and weights to f32 for that one
GEMM: the cast reads the weight once, the GEMM then runs at f32 speed, and the result is rounded back to
the activations' dtype, as a native half GEMM (f32 accumulation) would round it. Fewer rows (decode) run on
our AVX2 kernels (cpu_kernels.py) where they load: they stream f16 and bf16 weights at close to the memory's
bandwidth, while torch's bf16 matrix-vector product reaches under half of it. CUDA and f32 are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels

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

    _kernel: cpu_kernels.HalfMatrix | None = None
    out_dtype: torch.dtype | None = None
    """Set (float32) on a tensor-parallel rank's o_proj/down_proj: its partial sum stays unrounded until the
    all_reduce has added the ranks' parts (model.ModelSlice), so the sum is rounded once, as one rank's is."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not wants_float_gemm(input, self.weight):
            if self.weight.dtype in _HALF and cpu_kernels.handles(input) and cpu_kernels.available():
                return self._matrix()(input, self.out_dtype)
            y = F.linear(input, self.weight, self.bias)
            return y if self.out_dtype is None else y.to(self.out_dtype)
        bias = self.bias.float() if self.bias is not None else None
        return F.linear(input.float(), self.weight.float(), bias).to(self.out_dtype or input.dtype)

    def _matrix(self) -> cpu_kernels.HalfMatrix:
        """The weight as the kernel reads it, resolved on first use (weights are assigned after construction)."""
        if self._kernel is None or self._kernel.source is not self.weight:
            self._kernel = cpu_kernels.HalfMatrix(self.weight, self.bias)
        return self._kernel


def stack_rows(parts: list[Linear]) -> Linear | None:
    """One Linear whose output is the parts' outputs side by side (q/k/v, gate/up), so a decode step makes one
    kernel call where it made several; the parts' parameters become views of it (no memory is added). None when
    their dtypes, devices or biases differ."""
    first = parts[0]
    if len({(p.weight.dtype, p.weight.device, p.bias is None) for p in parts}) != 1:
        return None
    weight = torch.cat([p.weight for p in parts])
    fused = Linear(first.in_features, weight.shape[0], bias=first.bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)  # type: ignore[misc]
    start = 0
    for part in parts:
        rows = slice(start, start + part.out_features)
        part.weight = nn.Parameter(fused.weight[rows], requires_grad=False)
        if fused.bias is not None:
            part.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        start += part.out_features
    return fused
