"""Weight-only quantized linears and embeddings: MLX-community checkpoints as they ship, or float ones
quantized at load.

MLX's affine format stores each quantized matrix as packed `uint32` words (`weight`, 32/bits values per word,
lowest bits first) with one `scales` and one `biases` entry per group of `group_size` input columns:
w = scales * q + biases. Matmuls run on weight-only kernels, never on a dequantized matrix:
- ours (cpu_kernels.py, wherever they load): MLX's groups and values (f16 scales and biases; 8-bit values stored
  as q - 128 with the 128 folded into the biases), interleaved once at load in blocks of 8 output rows
  (`interleave8`), so the kernel computes 8 outputs per vector; any activation dtype;
- else torch's: 4-bit `_weight_int4pack_mm_for_cpu`, which computes w = (q - 8) * scale + zero per group, so
  an MLX group maps onto it exactly with zero = biases + 8 * scales; 8-bit `_weight_int8pack_mm`, which takes
  one symmetric scale per output row (MLX's groups are dequantized once at load and requantized per row, a small
  extra error bounded by the tests). Both want bfloat16 activations.
A quantized model computes in bfloat16 either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skulk.engines.footprint import BLOCK_ROWS, SUPPORTED_GROUPS, fp8_group
from skulk.engines.footprint import fitting_group as fitting_group  # the loader's; beside the card's arithmetic

from . import cpu_kernels
from .fp8 import block_size as fp8_block_size

INT4_ROWS = 16
"""torch's int4 packing needs the output dimension in multiples of 16; other sizes are zero-padded."""
INNER_K_TILES = 2
SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int
    prequantized: bool
    """True: the checkpoint holds MLX-packed weights; False: float weights quantized while loading."""
    fp8_only: bool = False
    """An FP8 block-scaled checkpoint held at 8 bits by default: only the weights the file stores as FP8 are
    quantized (each from its blocks, never as a whole float matrix), the float ones (embedding, norms, router,
    head) and footprint.FP8_FLOAT_KEPT stay as they are, in the model's dtype."""
    overrides: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False)
    """MLX's per-module entries (module path → bits, group size), e.g. MoE routers kept at 8 bits."""

    def for_module(self, path: str) -> QuantSpec:
        """The spec a module is packed with: its own entry in the checkpoint's quantization section, if any."""
        if path not in self.overrides:
            return self
        bits, group = self.overrides[path]
        return replace(self, bits=bits, group_size=group, overrides={})


def quant_spec(config: dict[str, Any], requested: str | None) -> QuantSpec | None:
    """How a checkpoint's linears are quantized: MLX's `quantization` section, else `requested`
    ("int4" / "int8") for a float checkpoint, else None. ValueError names what is not supported. gpt-oss's
    MXFP4 section (only its experts, which the loader dequantizes: mxfp4.py) counts as a float checkpoint.
    DeepSeek's block-scaled FP8 (fp8.py) is quantized at `requested` when one is, else its FP8 weights are held
    at 8 bits in groups of footprint.fp8_group (QuantSpec.fp8_only): about the file's bytes, where dequantizing
    them to bfloat16 would hold twice."""
    section = config.get("quantization") or config.get("quantization_config")
    if section and section.get("quant_method") == "mxfp4" and config.get("model_type") == "gpt_oss":
        section = None
    if (fp8_block := fp8_block_size(config)) is not None:  # block-scaled FP8: requantized while loading (fp8.py)
        section = None
        if not requested:
            return QuantSpec(8, fp8_group(fp8_block[1]), prequantized=False, fp8_only=True)
    if section:
        if "bits" not in section or "group_size" not in section:
            raise ValueError(f"unsupported quantization {section!r}; the engine loads MLX affine 4- and 8-bit")
        overrides = {key: (int(value["bits"]), int(value["group_size"])) for key, value in section.items()
                     if isinstance(value, dict) and "bits" in value and "group_size" in value}
        spec = QuantSpec(int(section["bits"]), int(section["group_size"]), prequantized=True, overrides=overrides)
    elif requested:
        bits = {"int4": 4, "int8": 8}.get(requested)
        if bits is None:
            raise ValueError(f"unsupported quantization {requested!r}; expected int4 or int8")
        spec = QuantSpec(bits, 64, prequantized=False)
    else:
        return None
    for bits, group in [(spec.bits, spec.group_size), *spec.overrides.values()]:
        if bits not in SUPPORTED_BITS or group not in SUPPORTED_GROUPS:
            raise ValueError(f"unsupported quantization: {bits}-bit, group {group}; the engine runs "
                             f"{SUPPORTED_BITS} bits with groups {SUPPORTED_GROUPS}")
    return spec


# --- MLX's affine format --------------------------------------------------------------------------------------
QUANTIZE_ELEMENTS = 1 << 20
"""Values quantized at a time: the float32 temporaries of quantizing one block of rows stay a few MiB, not
several float32 copies of the whole matrix (a load's peak is one tensor above what it keeps, issue 41)."""


def affine_quantize(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], scales [N, K/group], biases [N, K/group]) with w ≈ scales * q + biases, as MLX does;
    rows are independent, so they are quantized a block at a time."""
    return affine_quantize_rows(lambda start, stop: w[start:stop], w.shape[0], w.shape[1], bits, group)


def affine_quantize_rows(rows_of: Callable[[int, int], torch.Tensor], n: int, k: int, bits: int,
                         group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """affine_quantize of an [n, k] matrix whose rows [start, stop) rows_of gives on demand, QUANTIZE_ELEMENTS at a
    time: the float matrix never exists whole (an FP8 checkpoint's weights are dequantized a band at a time)."""
    q = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // group)
    low = torch.empty(n, k // group)
    rows = max(1, QUANTIZE_ELEMENTS // max(k, 1))
    for start in range(0, n, rows):
        block = slice(start, min(n, start + rows))
        q[block], scales[block], low[block] = _affine_block(rows_of(block.start, block.stop), bits, group)
    return q, scales, low


def _affine_block(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / (2**bits - 1)).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 2**bits - 1)
    return q.reshape(n, k).to(torch.uint8), scales, low


def pack_mlx(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values [N, K] → MLX's uint32 words [N, K * bits / 32], lowest bits first."""
    per_word = 32 // bits
    values = q.to(torch.int64).reshape(q.shape[0], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    return (values << shifts).sum(-1).to(torch.uint32)


def unpack_mlx(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """MLX's uint32 words [N, W] → uint8 values [N, W * 32 / bits]."""
    per_word = 32 // bits
    words = packed.to(torch.int64).unsqueeze(-1)
    shifts = torch.arange(per_word, dtype=torch.int64, device=packed.device) * bits  # a CUDA rank's embedding rows
    return ((words >> shifts) & (2**bits - 1)).reshape(packed.shape[0], -1).to(torch.uint8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    grouped = q.float().reshape(n, k // group, group)
    return (grouped * scales.float()[..., None] + biases.float()[..., None]).reshape(n, k)


def interleave8(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our kernels' layout (cpu_matmul.c) of values q (uint8 [N, K], for 8 bits already q - 128 as int8 bits) and
    their groups' scales and biases [N, K / group]: rows zero-padded to a multiple of 8, then per block of 8 rows
    and 8 columns c..c+7, 32 bytes (4 bits: byte 4n + j holds row n's column c+j in its low nibble and column
    c+4+j in its high one) or 64 (8 bits: row n's columns c..c+3 at bytes 4n.., its columns c+4..c+7 at
    32 + 4n..); scales and biases per block as [group][row]. Returns (bytes [N', K * bits / 8], f16 params
    [2, N', K / group]) for N' = N padded."""
    n, k = q.shape
    pad = -n % BLOCK_ROWS
    if pad:  # zero rows: value 0, scale 0, bias 0
        q, scales, biases = (F.pad(t, (0, 0, 0, pad)) for t in (q, scales, biases))
    blocks = q.reshape(-1, BLOCK_ROWS, k // 8, 2, 4).permute(0, 2, 3, 1, 4)  # [block, chunk, half, row, 4 columns]
    first, second = blocks[:, :, 0], blocks[:, :, 1]
    packed = first | (second << 4) if bits == 4 else blocks
    groups = scales.shape[1]
    params = torch.stack([scales, biases]).to(torch.float16).reshape(2, -1, BLOCK_ROWS, groups).transpose(2, 3)
    return packed.reshape(n + pad, k * bits // 8).contiguous(), params.reshape(2, n + pad, groups).contiguous()


# --- modules ----------------------------------------------------------------------------------------------------
class QuantizedLinear(nn.Module):
    """y = x @ w.T (+ bias) on a weight-only kernel. `kernel`: the layout is ours (weight: interleaved bytes
    [N rounded up to 8, K * bits / 8], params: f16 scales and biases [2, N rounded up to 8, K / group], bias f32,
    see interleave8); else torch's (weight: int4pack or int8 rows,
    params: int4 scales and zeros [K/group, N, 2] or int8 row scales [N], bias bf16)."""

    def __init__(self, bits: int, group: int, out_features: int, weight: torch.Tensor, params: torch.Tensor,
                 bias: torch.Tensor | None, *, kernel: bool = False) -> None:
        super().__init__()
        self.bits, self.group, self.out_features, self.kernel = bits, group, out_features, kernel
        self._matrix: cpu_kernels.QuantMatrix | None = None
        self.weight: torch.Tensor
        self.params: torch.Tensor
        self.register_buffer("weight", weight)
        self.register_buffer("params", params)
        if bias is not None:
            bias = bias.float() if kernel else bias.to(torch.bfloat16)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_affine(cls, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int,
                    bias: torch.Tensor | None = None) -> QuantizedLinear:
        """From MLX-style groups (q [N, K] values, scales/biases [N, K/group])."""
        n = q.shape[0]
        if _kernel_fits(group):
            if bits == 8:
                q = (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
                biases = biases.float() + 128 * scales.float()
            packed, params = interleave8(q, scales, biases, bits)
            return cls(bits, group, n, packed, params, bias, kernel=True)
        if bits == 8:
            return cls.int8_from_float(dequantize(q, scales, biases, group), group, bias)
        pad = -n % INT4_ROWS
        q32, scales, zeros = q.to(torch.int32), scales.float(), biases.float() + 8 * scales.float()
        if pad:  # padded rows are zero weights: q = 8 with scale 0 and zero 0
            q32 = F.pad(q32, (0, 0, 0, pad), value=8)
            scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, INNER_K_TILES)
        params = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        return cls(4, group, n, packed, params, bias)

    @classmethod
    def int8_from_float(cls, w: torch.Tensor, group: int, bias: torch.Tensor | None = None) -> QuantizedLinear:
        """8-bit from a float matrix: MLX-style groups for our kernel, else one symmetric scale per output row
        (the layout torch's int8 kernel takes)."""
        if _kernel_fits(group):
            return cls.from_affine(*affine_quantize(w, 8, group), 8, group, bias)
        w = w.float()
        row_scale = (w.abs().amax(-1) / 127).clamp(min=1e-8)
        w8 = (w / row_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(8, group, w.shape[0], w8, row_scale.to(torch.bfloat16), bias)

    out_dtype: torch.dtype | None = None
    """As matmul.Linear's: float32 partial sums on a tensor-parallel rank's o_proj/down_proj."""

    def kernel_matrix(self) -> cpu_kernels.QuantMatrix:
        """Our layout's matrix as the kernels read it, resolved on first use."""
        if self._matrix is None:
            self._matrix = cpu_kernels.QuantMatrix(self.weight, self.params, self.bits, self.group, self.bias,
                                                   self.out_features)
        return self._matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return self.kernel_matrix()(x, self.out_dtype)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if self.bits == 4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group, self.params)
            y = y[:, : self.out_features] if y.shape[-1] != self.out_features else y
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.params)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(self.out_dtype or x.dtype)


def stack_rows(parts: list[QuantizedLinear]) -> QuantizedLinear | None:
    """One linear whose output is the parts' outputs side by side (q/k/v, gate/up), sharing one call; the parts'
    buffers become views of it, so no memory is added. None when the parts are not all in our layout with the
    same bits and group, or one has padded rows (its row count is not a multiple of BLOCK_ROWS)."""
    first = parts[0]
    if not all(p.kernel and (p.bits, p.group) == (first.bits, first.group) and p.out_features % BLOCK_ROWS == 0
               for p in parts):
        return None
    if len({p.bias is None for p in parts}) != 1:
        return None
    weight = torch.cat([p.weight for p in parts])
    params = torch.cat([p.params for p in parts], dim=1)
    bias = torch.cat([p.bias for p in parts]) if first.bias is not None else None  # type: ignore[misc]
    fused = QuantizedLinear(first.bits, first.group, weight.shape[0], weight, params, bias, kernel=True)
    start = 0
    for part in parts:
        rows = slice(start, start + part.out_features)
        part.weight, part.params, part._matrix = weight[rows], params[:, rows], None
        if part.bias is not None and fused.bias is not None:
            part.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        start += part.out_features
    return fused


def _kernel_fits(group: int) -> bool:
    """Our kernels take groups of 32 columns up to MAX_GROUP; they run where they load."""
    return group % 32 == 0 and group <= cpu_kernels.MAX_GROUP and cpu_kernels.available()


class QuantizedEmbedding(nn.Module):
    """Token embeddings kept in MLX's packed form; only the rows looked up are dequantized."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.bits, self.group, self.dtype = bits, group, dtype
        self.weight: torch.Tensor
        self.scales: torch.Tensor
        self.biases: torch.Tensor
        self.register_buffer("weight", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("biases", biases)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(unpack_mlx(self.weight[flat], self.bits), self.scales[flat], self.biases[flat], self.group)
        return rows.to(self.dtype).reshape(*ids.shape, -1)

    def affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, scales, biases) of the whole table, for a tied lm_head."""
        return unpack_mlx(self.weight, self.bits), self.scales, self.biases
