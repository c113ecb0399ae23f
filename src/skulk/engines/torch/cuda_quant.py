"""Weight-only int4 and int8 linears on CUDA, through torch's own kernels.

Why these: they ship inside torch (nothing more to install or pin beside the CUDA build of torch itself), they
are maintained with it, and they read the same affine groups the CPU path reads (quant.py), so a checkpoint
loads the same way on either device:
- 4 bits: `_weight_int4pack_mm`, the tinygemm kernel gpt-fast and torchao's int4 weight-only path run on
  (Ampere, sm80, and later). It computes w = (q - 8) * scale + zero per group, as its CPU twin does, so an MLX
  group maps exactly with zero = biases + 8 * scales. Its packing differs from the CPU's: the input is uint8
  [N, K / 2] with two values per byte (even column in the high nibble), and `_convert_weight_to_int4pack` must
  run on the GPU. K must split into tiles of inner_k_tiles * 16 columns (`inner_k_tiles`).
- 8 bits: `_weight_int8pack_mm` (int8 rows, one symmetric bf16 scale per output row, as on the CPU) where torch
  registers a CUDA kernel for it; where it does not, the same rows are dequantized on the fly inside the matmul
  (F.linear on the int8 rows cast to bf16, times the row scales): correct everywhere, slower than bf16 for
  decode, which cuda_check.sh's int8 figure then shows.
torchao would add faster int8 and Marlin-style int4 kernels, at the cost of a second CUDA-versioned dependency;
these are the first version. Activations are bfloat16 on both, as a quantized model computes on the CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .quant import INT4_ROWS, QuantizedLinear, dequantize

INNER_K_TILES = (8, 4, 2)
"""tinygemm's tile widths (in 16-column units), widest first: the widest that divides K is used."""


def inner_k_tiles(columns: int) -> int:
    """The widest tile the int4 kernel takes for K columns; ValueError when K does not split into any."""
    for tiles in INNER_K_TILES:
        if columns % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"int4 on CUDA needs the columns in multiples of 32, not {columns}")


def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """uint8 values [N, K] (0..15) → uint8 [N, K / 2], even column in the high nibble: the layout
    `_convert_weight_to_int4pack` reads on CUDA."""
    q = q.to(torch.uint8)
    return ((q[:, ::2] << 4) | q[:, 1::2]).contiguous()


@functools.cache
def int8_kernel() -> bool:
    """True when this torch build has a CUDA kernel for `_weight_int8pack_mm`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")


class CudaQuantizedLinear(QuantizedLinear):
    """QuantizedLinear in torch's CUDA layouts (weight: int4pack tiles or int8 rows; params: int4 scales and zeros
    [K / group, N, 2] or int8 row scales [N]; bias bf16). Never `kernel` (ours are CPU-only), so it never stacks
    with its neighbours: each projection is its own call, as torch's layouts are on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        if self.bits == 4:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.weight, self.group, self.params)
            y = y[:, : self.out_features] if y.shape[-1] != self.out_features else y
        elif int8_kernel():
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.params)
        else:
            y = F.linear(flat, self.weight.to(flat.dtype)) * self.params
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(self.out_dtype or x.dtype)


def cuda_from_affine(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int,
                     bias: torch.Tensor | None, device: torch.device) -> CudaQuantizedLinear:
    """From MLX-style groups (q [N, K] values, scales/biases [N, K / group]) on the host, packed on device."""
    if bits == 8:
        return cuda_int8_from_float(dequantize(q, scales, biases, group), group, bias, device)
    n, k = q.shape
    tiles = inner_k_tiles(k)
    zeros = biases.float() + 8 * scales.float()
    scales = scales.float()
    pad = -n % INT4_ROWS
    if pad:  # padded rows are zero weights: q = 8 with scale 0 and zero 0
        q = F.pad(q.to(torch.int32), (0, 0, 0, pad), value=8)
        scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
    pairs = pack_int4_pairs(q).to(device)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(f"int4 weights on {device}: torch's int4 kernel does not run here ({exc}); "
                         "it needs an NVIDIA GPU of compute capability 8.0 or later") from exc
    params = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous().to(device)
    return CudaQuantizedLinear(4, group, n, packed, params, _on(bias, device))


def cuda_int8_from_float(w: torch.Tensor, group: int, bias: torch.Tensor | None,
                         device: torch.device) -> CudaQuantizedLinear:
    """8-bit rows with one symmetric scale per output row (what `_weight_int8pack_mm` takes), moved to device."""
    w = w.float()
    row_scale = (w.abs().amax(-1) / 127).clamp(min=1e-8)
    w8 = (w / row_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return CudaQuantizedLinear(8, group, w.shape[0], w8.to(device), row_scale.to(torch.bfloat16).to(device),
                               _on(bias, device))


def _on(bias: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return bias.to(device) if bias is not None else None
