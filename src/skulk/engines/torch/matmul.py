"""Float linears that compute on the path the CPU runs fastest for the step's shape.

On x86 CPUs without native half-precision matmul units (AVX2 machines, most AMD EPYCs), torch multiplies
f16 and bf16 matrices fast only one row at a time (a vectorised gemv); with more rows it falls back to a
generic loop that is 5-10x slower than the f32 GEMM (bench/engine.py: prefill). So weights stay stored in
their dtype (memory is what counts), a decode step of few rows runs them as they are, and a step of
FLOAT_GEMM_ROWS rows or more (prefill, a large batch) casts activations and weights to f32 for that one
GEMM: the cast reads the weight once, the GEMM then runs at f32 speed, and the result is rounded back to
the activations' dtype, as a native half GEMM (f32 accumulation) would round it. Where the CPU has bf16 GEMM
units (AVX-512 BF16, AMX) torch's own bf16 GEMM is faster still, and bf16 uses it (native_bf16_gemm). The
weight is cast in blocks of rows into one reused buffer: a fresh f32 copy of a whole matrix is larger than
malloc's mmap threshold, so every cast paid for its pages again (a quarter of the cast-and-GEMM time on the
bench's gate/up matrix).
Fewer rows (decode) run on our AVX2 kernels (cpu_kernels.py) where they load: they stream f16 and bf16 weights
at close to the memory's bandwidth, while torch's bf16 matrix-vector product reaches under half of it. CUDA
and f32 are untouched.
"""

from __future__ import annotations

import functools
import threading

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
_KERNEL_WEIGHTS = (*_HALF, torch.float32)
CAST_ELEMENTS = 1 << 22
"""f32 values (16 MiB) of weight cast at a time for the f32 GEMM: a buffer kept per thread."""
_cast = threading.local()


@functools.cache
def native_bf16_gemm() -> bool:
    """True where torch multiplies bf16 matrices in hardware (oneDNN on AVX-512 BF16 or AMX: Zen 4, Cooper Lake,
    Sapphire Rapids and later). There a bf16 GEMM runs 2.5-3x faster than the f32 cast (512 x 1024 x 9728 on the
    2-core Zen 4: 28 ms against 85) and from 8 rows about as fast as our kernel, so bf16 skips the cast."""
    flags = cpu_kernels.cpu_flags()
    return torch.backends.mkldnn.is_available() and ("avx512_bf16" in flags or "amx_bf16" in flags)


def wants_float_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when this matmul is faster in f32: half weights on the CPU, FLOAT_GEMM_ROWS rows or more (bf16 where
    the CPU has no bf16 GEMM of its own)."""
    return (weight.dtype in _HALF and weight.device.type == "cpu" and x.numel() >= FLOAT_GEMM_ROWS * x.shape[-1]
            and not (weight.dtype == torch.bfloat16 and native_bf16_gemm()))


def uses_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when this matmul runs on skulk_half_mv: f16/bf16 weights below FLOAT_GEMM_ROWS rows, and f32 ones too
    (torch's f32 GEMM repacks the weight for every call of a few rows: 8 decode rows took 2.5x one)."""
    return (weight.dtype in _KERNEL_WEIGHTS and weight.device.type == "cpu" and cpu_kernels.handles(x)
            and x.numel() < FLOAT_GEMM_ROWS * x.shape[-1] and cpu_kernels.available())


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) with the CPU's fast path per shape."""

    _kernel: cpu_kernels.HalfMatrix | None = None
    out_dtype: torch.dtype | None = None
    """Set (float32) on lm_head, whose logits are sampled unrounded, and on a tensor-parallel rank's
    o_proj/down_proj, whose partial sum stays unrounded until the all_reduce has added the ranks' parts
    (model.ModelSlice), so the sum is rounded once, as one rank's is. Every path returns the f32 accumulator as it
    is, never a half result widened afterwards."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not wants_float_gemm(input, self.weight):
            if uses_kernel(input, self.weight):
                return self._matrix()(input, self.out_dtype)
            if self.out_dtype is None or self.out_dtype == self.weight.dtype == input.dtype:
                return F.linear(input, self.weight, self.bias)
            if input.device.type == "cuda":
                return cuda_linear(input, self.weight, self.bias, self.out_dtype)
        return float_linear(input, self.weight, self.bias, self.out_dtype or input.dtype)

    def _matrix(self) -> cpu_kernels.HalfMatrix:
        """The weight as the kernel reads it, resolved on first use (weights are assigned after construction)."""
        if self._kernel is None or self._kernel.source is not self.weight:
            self._kernel = cpu_kernels.HalfMatrix(self.weight, self.bias)
        return self._kernel


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x @ weight.T (+ bias) computed in f32 and rounded to dtype, the half weight cast block by block of rows
    into a reused buffer; each block's GEMM fills its columns of the result."""
    n, k = weight.shape
    rows = max(1, min(n, CAST_ELEMENTS // k))
    buffer: torch.Tensor | None = getattr(_cast, "buffer", None)
    if buffer is None or buffer.numel() < rows * k:
        buffer = _cast.buffer = torch.empty(max(rows * k, CAST_ELEMENTS))
    flat = x.reshape(-1, k).float()
    out = torch.empty(flat.shape[0], n, dtype=dtype)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        block = buffer[: (stop - start) * k].view(stop - start, k)
        block.copy_(weight[start:stop])
        part = torch.mm(flat, block.t()) if bias is None else torch.addmm(bias[start:stop].float(), flat, block.t())
        out[:, start:stop] = part
    return out.reshape(*x.shape[:-1], n)


def cuda_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x @ weight.T (+ bias) on CUDA with the result in dtype straight from the GEMM's accumulator (torch.mm's
    out_dtype: f16/bf16 inputs, f32 out), so no f32 copy of the weight is made per call."""
    flat = x.reshape(-1, x.shape[-1])
    if x.dtype == weight.dtype and x.dtype in _HALF and dtype == torch.float32:
        out = torch.mm(flat, weight.t(), out_dtype=dtype)
    else:
        out = torch.mm(flat.to(dtype), weight.t().to(dtype))
    if bias is not None:
        out += bias.to(dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def stack_rows(parts: list[Linear]) -> Linear | None:
    """One Linear whose output is the parts' outputs side by side (q/k/v, gate/up), so a decode step makes one
    kernel call where it made several; the parts' parameters become views of it (no memory is kept twice: the
    loader reads the parts into consecutive rows of one buffer, which is used as it is). None when their
    dtypes, devices or biases differ."""
    first = parts[0]
    if len({(p.weight.dtype, p.weight.device, p.bias is None) for p in parts}) != 1:
        return None
    weight = stacked([p.weight for p in parts])
    fused = Linear(first.in_features, weight.shape[0], bias=first.bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(stacked([p.bias for p in parts]), requires_grad=False)  # type: ignore[misc]
    start = 0
    for part in parts:
        rows = slice(start, start + part.out_features)
        part.weight = nn.Parameter(fused.weight[rows], requires_grad=False)
        if fused.bias is not None:
            part.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        start += part.out_features
    return fused


def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts one after another along their first dimension: the buffer they already are consecutive rows of
    (loader.py reads stacked projections that way), else a new one (torch.cat)."""
    first = parts[0]
    at, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for part in parts:
        if (not part.is_contiguous() or part.data_ptr() != at or part.untyped_storage().data_ptr() != storage
                or part.dtype != first.dtype or part.shape[1:] != first.shape[1:]):
            return torch.cat(parts)
        at += part.numel() * part.element_size()
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    return first.detach().as_strided(shape, torch.empty(shape, device="meta").stride(), first.storage_offset())
