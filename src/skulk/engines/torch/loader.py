"""Load one slice and one tensor-parallel shard of a Hugging Face checkpoint, reading only the bytes it owns.

Each tensor is read from its safetensors file with plain reads straight into the buffer the model keeps
(tensor_file.py), so a pipeline stage holding layers 8-15 never reads layers 0-7, a tensor-parallel rank reads
only its rows or columns of each split weight, and a rank holds its shard once: q/k/v and gate/up are read into
consecutive rows of one buffer that fuse_projections then uses as it is, a weight quantized while loading
replaces its float original one tensor at a time, and no mapping of the file outlives the load (issue 41).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import re
import sys
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from skulk.engines.footprint import FP8_FLOAT_KEPT
from skulk.formats import InvalidModelFile
from skulk.formats.checkpoint import read_config, safetensors_header

from . import cpu_kernels, fp8, mxfp4
from .config import parse_dtype
from .cuda_quant import cuda_from_affine, cuda_int8_from_float
from .gguf_file import open_gguf
from .layers import AllReduce, Attention, GatedMLP, fuse_projections
from .model import ModelSlice, partial_sum_bias, tp_split_dim
from .models import read_args
from .quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantSpec,
    affine_quantize,
    affine_quantize_rows,
    fitting_group,
    pack_mlx,
    quant_spec,
    unpack_mlx,
)
from .tensor_file import TensorFile, TensorSlice

_INDEX_FILE = "model.safetensors.index.json"
GGUF_SUFFIX = ".gguf"


def load_model(
    model_dir: Path,
    *,
    start_layer: int = 0,
    end_layer: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    all_reduce: AllReduce | None = None,
    dtype: str | torch.dtype | None = None,
    device: torch.device | str = "cpu",
    quantize: str | None = None,
) -> ModelSlice:
    """Build the slice and fill it with its weights, in the config's dtype unless dtype overrides it.

    An MLX-quantized checkpoint loads quantized as it ships; `quantize` ("int4"/"int8") quantizes a float one
    while loading (engines/torch/quant.py). Quantized models compute in bfloat16, what the kernels want; an FP8
    block-scaled checkpoint, its FP8 weights held at 8 bits unless `quantize` says otherwise (fp8.py), keeps the
    config's dtype for what it stores in float."""
    config = read_config(model_dir / "config.json")
    quant = quant_spec(config, quantize)
    args = read_args(config)
    if dtype is not None or (quant is not None and not quant.fp8_only):
        args = dataclasses.replace(args, dtype=parse_dtype(dtype or torch.bfloat16))
    model = ModelSlice(
        args, start_layer=start_layer, end_layer=end_layer,
        tp_rank=tp_rank, tp_size=tp_size, all_reduce=all_reduce, device=device,
    )
    files = _weight_files(model_dir)
    with ExitStack() as stack:
        names = CheckpointNames(args.tie_word_embeddings, _text_prefix(files), files, _stacked_experts(files), stack,
                                fp8_block=fp8.block_size(config))
        if quant is not None:
            _quantize_modules(model, names, quant, Split(tp_rank, tp_size), torch.device(device))
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if t.is_meta}
        tensors = _read_tensors(model_dir.name, names, expected, _stacked_destinations(model, expected, args.dtype,
                                torch.device(device)), Split(tp_rank, tp_size), _tp_parts(model))
    model.load_state_dict(tensors, strict=False, assign=True)
    del tensors
    if torch.device(device).type != "cpu":
        model.to(device)  # what quantizing built on the host (a packed embedding's buffers); the rest is there
    fuse_projections(model)
    release_free_memory()
    return model.eval().requires_grad_(False)


_TEXT_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
"""Where a checkpoint keeps its decoder: a text model under model.; a multimodal Gemma 3 under
language_model.model. (hub and MLX layout) or model.language_model. (newer transformers), next to a vision tower
this engine does not load."""


def _text_prefix(files: Iterable[str]) -> str:
    names = list(files)
    for prefix in _TEXT_PREFIXES:
        if any(n.startswith(f"{prefix}layers.") or n.startswith(f"{prefix}embed_tokens.") for n in names):
            return prefix
    return "model."


_SWITCH = re.compile(r"^(.*\.mlp\.)switch_mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
_FUSED = re.compile(r"^(.*\.mlp\.)experts\.(gate_up_proj|down_proj)$")


class Stacked(NamedTuple):
    """Where one expert's matrix sits in a stacked tensor: its index along the first dimension, and its rows when
    it is part of them (a fused gate_up_proj's gate or up half: first row, count)."""

    tensor: str
    expert: int
    rows: tuple[int, int] | None = None


def _stacked_experts(files: dict[str, Path]) -> dict[str, Stacked]:
    """Per-expert names → where they sit in the tensor that stacks a layer's experts: MLX's [num_experts, out, in]
    per projection (Qwen3-MoE's mlp.switch_mlp.gate_proj, ...), or transformers 5's mlp.experts.gate_up_proj
    [num_experts, 2 x width, hidden] (gate rows, then up rows) and mlp.experts.down_proj [num_experts, hidden,
    width], as Qwen3.5's published checkpoints keep them. A stacked tensor whose file this directory lacks is left
    out: a pipeline stage holds only the shards it needs (store/files.files_for_shard), and none holds the one
    with Qwen3.5's multi-token-prediction experts (mtp.layers.0.mlp.experts.*), which no rank loads."""
    stacked: dict[str, Stacked] = {}
    for name in files:
        if (_SWITCH.match(name) or _FUSED.match(name)) and not files[name].exists():
            continue
        if match := _SWITCH.match(name):
            start, projection, part = match.groups()
            for expert in range(_shape(files[name], name)[0]):
                stacked[f"{start}experts.{expert}.{projection}.{part}"] = Stacked(name, expert)
        elif (match := _FUSED.match(name)) and len(shape := _shape(files[name], name)) == 3:
            start, projection = match.groups()
            width = shape[1] // 2
            for expert in range(shape[0]):
                if projection == "down_proj":
                    stacked[f"{start}experts.{expert}.down_proj.weight"] = Stacked(name, expert)
                else:
                    stacked[f"{start}experts.{expert}.gate_proj.weight"] = Stacked(name, expert, (0, width))
                    stacked[f"{start}experts.{expert}.up_proj.weight"] = Stacked(name, expert, (width, width))
    return stacked


def _shape(path: Path, name: str) -> list[int]:
    if path.suffix == GGUF_SUFFIX:
        return list(open_gguf(path).shape(name))
    return [int(n) for n in safetensors_header(path)[name]["shape"]]


@dataclass
class CheckpointNames:
    """Maps the slice's parameter names onto the checkpoint's tensor names, and reads them (each file opened
    once per load, in `stack`)."""

    tied: bool
    prefix: str
    files: dict[str, Path]
    stacked: dict[str, Stacked] = field(default_factory=dict)
    stack: ExitStack = field(default_factory=ExitStack)
    handles: dict[Path, Any] = field(default_factory=dict)
    fp8_block: tuple[int, int] | None = None
    """Block-scaled FP8 weights (fp8.py): a weight with a `_scale_inv` beside it is dequantized as it is read."""

    def __contains__(self, tensor: str) -> bool:
        return tensor in self.files or tensor in self.stacked

    @property
    def packed(self) -> bool:
        """Quantized values come packed in uint32 words (MLX's safetensors), not one per byte (a GGUF file)."""
        return not any(path.suffix == GGUF_SUFFIX for path in self.files.values())

    def read(self, tensor: str, dim: int | None, split: Split, out: torch.Tensor | None = None,
             parts: tuple[int, ...] | None = None) -> torch.Tensor:
        """A whole tensor, or this rank's block along dim; one expert's matrix of a stacked tensor; of a tensor
        made of `parts` (consecutive row counts: _tp_parts), this rank's rows of each. Into out (its dtype and
        device) when given, else a new tensor in the file's dtype."""
        if parts is not None and split.size > 1:
            whole = self.read(tensor, None, Split(0, 1)).split(list(parts))
            block = torch.cat([part.chunk(split.size)[split.rank] for part in whole])
            return block if out is None else out.copy_(block)
        real, expert, rows = self.stacked.get(tensor, (tensor, None, None))
        if real not in self.files:
            raise ValueError(f"checkpoint has no tensor {tensor}")
        if self.fp8_block is not None and expert is None and f"{real}{fp8.SCALE_SUFFIX}" in self.files:
            return self._read_fp8(real, dim, split, out, self.fp8_block)
        return self._read(real, expert, dim, split, out, rows)

    def _read(self, real: str, expert: int | None, dim: int | None, split: Split,
              out: torch.Tensor | None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        path = self.files[real]
        if path not in self.handles:
            # a safetensors header is checked against its file as it opens (a stage opens only the files it holds)
            self.handles[path] = open_gguf(path) if path.suffix == GGUF_SUFFIX else self.stack.enter_context(
                TensorFile(path))
        return _shard(self.handles[path].get_slice(real), dim, split.rank, split.size, expert, out, rows)

    def _read_fp8(self, real: str, dim: int | None, split: Split, out: torch.Tensor | None,
                  block: tuple[int, int]) -> torch.Tensor:
        """A block-scaled FP8 weight (fp8.py) dequantized whole, straight into out when it is the whole tensor,
        else into a tensor of out's dtype (float32 for a weight quantized again while loading) cut to this rank's
        block along dim."""
        whole = Split(0, 1)
        weight = self._read(real, None, None, whole, None)
        scales = self._read(f"{real}{fp8.SCALE_SUFFIX}", None, None, whole, None)
        if dim is None or split.size == 1:
            if out is not None and out.shape != weight.shape:
                raise ShapeMismatch(f"shape {tuple(weight.shape)}, expected {tuple(out.shape)}")
            return fp8.dequantize(weight, scales, block, out)
        values = fp8.dequantize(weight, scales, block, dtype=torch.float32 if out is None else out.dtype)
        size = values.shape[dim] // split.size
        values = values.narrow(dim, split.rank * size, size)
        if out is None:
            return values.contiguous()
        if values.shape != out.shape:
            raise ShapeMismatch(f"shape {tuple(values.shape)}, expected {tuple(out.shape)}")
        return out.copy_(values)

    def fp8_rows(self, tensor: str, dim: int | None, split: Split) -> tuple[RowReader, int, int] | None:
        """Of a block-scaled FP8 weight (not a stacked expert's), this rank's block along dim as (rows [a, b) in
        float32 on demand, its rows, its columns): the FP8 bytes are read whole, the floats a band at a time
        (fp8.dequantize_rows). None when the checkpoint stores the tensor otherwise."""
        real, expert, _ = self.stacked.get(tensor, (tensor, None, None))
        if self.fp8_block is None or expert is not None or f"{real}{fp8.SCALE_SUFFIX}" not in self.files:
            return None
        block, whole = self.fp8_block, Split(0, 1)
        weight = self._read(real, None, None, whole, None)
        scales = self._read(f"{real}{fp8.SCALE_SUFFIX}", None, None, whole, None)
        fp8.check_scales(weight, scales, block)
        (rows, cols), first, column = weight.shape, 0, 0
        if dim == 0 and split.size > 1:
            rows //= split.size
            first = split.rank * rows
        elif dim == 1 and split.size > 1:
            cols //= split.size
            column = split.rank * cols
        return (lambda a, b: fp8.dequantize_rows(weight, scales, block, first + a, first + b)[:, column:column + cols],
                rows, cols)

    def quant_path(self, base: str) -> str:
        """The module path a per-module quantization entry names: a stacked expert's is its switch_mlp tensor."""
        real = self.stacked[f"{base}.weight"].tensor if f"{base}.weight" in self.stacked else f"{base}.weight"
        return real.removesuffix(".weight")

    def source(self, param: str) -> str:
        """The checkpoint tensor behind a parameter; a tied lm_head reads the embedding."""
        if param.startswith("lm_head."):
            for candidate in (param, f"language_model.{param}"):
                if candidate in self.files:
                    return candidate
            if not self.tied:
                return param
            return f"{self.prefix}embed_tokens." + param.removeprefix("lm_head.")
        return f"{self.prefix}{param}"


RowReader = Callable[[int, int], torch.Tensor]
"""Rows [a, b) of a matrix, read on demand (CheckpointNames.fp8_rows)."""


def _tp_parts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameters made of consecutive parts that each split across tensor-parallel ranks (a module's tp_parts:
    Qwen3-Next's conv over q, k and v channels), by their whole parts' sizes along dim 0."""
    return {f"{name}.{tensor}": sizes for name, module in model.named_modules()
            for tensor, sizes in getattr(module, "tp_parts", {}).items()}


def _read_tensors(
    name: str,
    names: CheckpointNames,
    expected: dict[str, tuple[int, ...]],
    destinations: dict[str, torch.Tensor],
    split: Split,
    parted: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter still on the meta device, read into its destination: its rows of a stacked buffer, or a
    buffer of its own in the slice's dtype; of a parameter in `parted` (_tp_parts), this rank's rows of each
    part."""
    loaded: dict[str, torch.Tensor] = {}
    read: dict[tuple[str, int | None], torch.Tensor] = {}
    for param, out in destinations.items():
        source, dim = names.source(param), tp_split_dim(param)
        if parted and param in parted and split.size > 1:
            loaded[param] = names.read(source, None, split, out, parted[param])
            continue
        if split.rank and partial_sum_bias(param):
            loaded[param] = out.zero_()  # added once, by rank 0: the all_reduce sums the ranks' outputs
            continue
        if source not in names and f"{source}_blocks" in names:
            loaded[param] = _read_mxfp4(names, source, dim, split, out)
            continue
        if source not in names:
            raise ValueError(f"{name}: checkpoint has no tensor {source}")
        if (same := read.get((source, dim))) is not None and same.shape == out.shape:
            loaded[param] = same  # a tied lm_head beside its embedding: one tensor, not a copy
            continue
        try:
            loaded[param] = read[(source, dim)] = names.read(source, dim, split, out)
        except ShapeMismatch as exc:
            raise ValueError(f"{source}: {exc}") from None
    return loaded


def _read_mxfp4(names: CheckpointNames, source: str, dim: int | None, split: Split, out: torch.Tensor) -> torch.Tensor:
    """A stacked expert tensor the checkpoint keeps in MXFP4 (gpt-oss: `<source>_blocks` and `_scales`, each
    expert's [out, in] rows), dequantized one expert at a time into out ([experts, in, out], the float tensor's
    layout), this rank's block along dim."""
    blocks = names.read(f"{source}_blocks", None, Split(0, 1))
    scales = names.read(f"{source}_scales", None, Split(0, 1))
    if blocks.shape[0] != out.shape[0]:
        raise ValueError(f"{source}: {blocks.shape[0]} experts in MXFP4, expected {out.shape[0]}")
    for expert in range(out.shape[0]):
        values = mxfp4.dequantize(blocks[expert], scales[expert], out.dtype).T
        if dim is not None and split.size > 1:
            block = values.shape[dim - 1] // split.size
            values = values.narrow(dim - 1, split.rank * block, block)
        if values.shape != out.shape[1:]:
            raise ValueError(f"{source}: MXFP4 expert of shape {tuple(values.shape)}, expected {tuple(out.shape[1:])}")
        out[expert].copy_(values)
    return out


class ShapeMismatch(ValueError):
    """A checkpoint tensor (this rank's block of it) is not the shape its parameter has."""


_STACKED = {Attention: ("q_proj", "k_proj", "v_proj"), GatedMLP: ("gate_proj", "up_proj")}
"""The projections fuse_projections stacks (layers.py), in its order."""


def _stacked_destinations(model: ModelSlice, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
                          device: torch.device) -> dict[str, torch.Tensor]:
    """Where each parameter is read to (new tensors are allocated, not yet touched): the float projections that
    fuse_projections stacks get consecutive rows of one buffer, which it then keeps as the stacked weight
    instead of copying them (matmul.stack_rows); the others a buffer each, in float32 where a module keeps it so
    (its float32_tensors: a MoE router's correction bias, moe.SigmoidRouter)."""
    out: dict[str, torch.Tensor] = {}
    kept: set[str] = set()
    for name, module in model.named_modules():
        kept.update(f"{name}.{tensor}" for tensor in getattr(module, "float32_tensors", ()))
        parts = next((p for kind, p in _STACKED.items() if isinstance(module, kind)), None)
        for suffix in ("weight", "bias") if parts else ():
            keys = [f"{name}.{part}.{suffix}" for part in parts or ()]
            if not all(k in expected for k in keys):
                continue  # a quantized or absent part: nothing stacks as float
            rows = [expected[k][0] for k in keys]
            buffer = torch.empty((sum(rows), *expected[keys[0]][1:]), dtype=dtype, device=device)
            for key, block in zip(keys, buffer.split(rows), strict=True):
                out[key] = block
    return {param: out[param] if param in out else
            torch.empty(shape, dtype=torch.float32 if param in kept else dtype, device=device)
            for param, shape in expected.items()}


def release_free_memory() -> None:
    """Hand the C allocator's free pages back to the system (glibc's malloc_trim): the temporaries of a load (a
    tensor converted or quantized, parts replaced by their stacked form) leave free holes in the heap, which
    would otherwise stay resident. Elsewhere a no-op."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


@dataclass(frozen=True)
class Split:
    rank: int
    size: int


def _quantize_modules(model: ModelSlice, names: CheckpointNames, quant: QuantSpec, split: Split,
                      device: torch.device) -> None:
    """Swap every projection (and lm_head; the embedding too when the checkpoint packs it) for its quantized
    form, read straight from the checkpoint; what stays float is loaded afterwards as usual. Quantizing at load
    leaves a MoE router (mlp.gate) in float: it is small, and its error would flip which experts run. On CUDA the
    projections take torch's CUDA layouts (cuda_quant.py); the values are read and quantized on the host. An FP8
    checkpoint held at 8 bits by default (QuantSpec.fp8_only) swaps only what the file stores as FP8, less
    footprint.FP8_FLOAT_KEPT (MLA's kv_b_proj, absorbed by decode)."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]
    parted = _tp_parts(model)  # before the swaps: a replacement does not carry its original's tp_parts
    for name, module in targets:
        base = names.source(f"{name}.weight").removesuffix(".weight")
        replacement: nn.Module | None
        if isinstance(module, nn.Embedding):
            replacement = _packed_embedding(names, base, quant, model.args.dtype) if quant.prequantized else None
        elif (name.endswith(".mlp.gate") and not quant.prequantized) or _kept_float(name, base, names, quant):
            replacement = None
        else:
            dim = tp_split_dim(f"{name}.weight")
            bias = names.read(f"{base}.bias", 0 if dim == 0 else None, split) if module.bias is not None else None
            if bias is not None and split.rank and partial_sum_bias(f"{name}.bias"):
                bias = torch.zeros_like(bias)
            build = _packed_linear if quant.prequantized else _quantized_float_linear
            replacement = build(names, base, dim, split, quant, bias, device, parted.get(f"{name}.weight"))
        if replacement is not None:
            if isinstance(replacement, QuantizedLinear) and isinstance(module, nn.Linear):
                replacement.out_dtype = getattr(module, "out_dtype", None)
            model.set_submodule(name, replacement)
        release_free_memory()  # the float original and the quantizer's temporaries: holes the next one may not fit


def _kept_float(name: str, base: str, names: CheckpointNames, quant: QuantSpec) -> bool:
    """Under QuantSpec.fp8_only: a projection the file stores in float, or one of FP8_FLOAT_KEPT."""
    return quant.fp8_only and (f"{base}.weight{fp8.SCALE_SUFFIX}" not in names or
                               name.rsplit(".", 1)[-1] in FP8_FLOAT_KEPT)


def _packed_embedding(names: CheckpointNames, base: str, quant: QuantSpec, dtype: torch.dtype) -> nn.Module | None:
    if f"{base}.scales" not in names:
        return None
    quant = quant.for_module(base)
    q_packed, scales, biases = (names.read(f"{base}.{part}", None, Split(0, 1)) for part in _PARTS)
    if not names.packed:
        q_packed = pack_mlx(q_packed, quant.bits)
    return QuantizedEmbedding(q_packed, scales, biases, quant.bits, quant.group_size, dtype)


def _packed_linear(names: CheckpointNames, base: str, dim: int | None, split: Split, quant: QuantSpec,
                   bias: torch.Tensor | None, device: torch.device,
                   parts: tuple[int, ...] | None = None) -> nn.Module | None:
    """An MLX-packed projection, at the bits its module's own quantization entry gives if it has one (MLX keeps
    MoE routers at 8 bits); this rank's rows (of each of its parts), or its columns in whole groups."""
    if f"{base}.scales" not in names:
        return None  # a layer the checkpoint left in float stays an nn.Linear
    quant = quant.for_module(names.quant_path(base))
    q_packed, scales, biases = (names.read(f"{base}.{part}", dim, split, parts=parts) for part in _PARTS)
    q = unpack_mlx(q_packed, quant.bits) if names.packed else q_packed
    if q.shape[1] != scales.shape[1] * quant.group_size:
        raise ValueError(f"{base}: its columns do not split across {split.size} tensor-parallel ranks in whole "
                         f"groups of {quant.group_size}; use fewer ranks")
    return _affine_linear(q, scales, biases, quant.bits, quant.group_size, bias, device)


def _affine_linear(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int,
                   bias: torch.Tensor | None, device: torch.device) -> QuantizedLinear:
    """MLX-style groups as the device's quantized linear: ours or torch's CPU layout, else torch's CUDA one."""
    if device.type == "cpu":
        return QuantizedLinear.from_affine(q, scales, biases, bits, group, bias)
    return cuda_from_affine(q, scales, biases, bits, group, bias, device)


def _quantized_float_linear(names: CheckpointNames, base: str, dim: int | None, split: Split, quant: QuantSpec,
                            bias: torch.Tensor | None, device: torch.device,
                            parts: tuple[int, ...] | None = None) -> nn.Module | None:
    """A float projection quantized while loading: int8 per row (in groups on our kernels), int4 in groups. An FP8
    one (CheckpointNames.fp8_rows) is dequantized and quantized a band of rows at a time where its groups are
    kept as they are (int4; int8 on our kernels); on CUDA at 8 bits, as a float one is (whole, then per row)."""
    banded = parts is None and (quant.bits == 4 or (device.type == "cpu" and cpu_kernels.available()))
    if banded and (fp8_rows := names.fp8_rows(f"{base}.weight", dim, split)) is not None:
        rows_of, n, k = fp8_rows
        group = fitting_group(k, quant.group_size)
        if group is None:
            return None
        q, scales, biases = affine_quantize_rows(rows_of, n, k, quant.bits, group)
        return _affine_linear(q, scales, biases, quant.bits, group, bias, device)
    weight = names.read(f"{base}.weight", dim, split, parts=parts)
    group = fitting_group(weight.shape[1], quant.group_size)
    if group is None:
        return None  # no group size divides its columns: it stays float, the rest is quantized
    if quant.bits == 8:
        if device.type != "cpu":
            return cuda_int8_from_float(weight, group, bias, device)
        return QuantizedLinear.int8_from_float(weight, group, bias)
    q, scales, biases = affine_quantize(weight, quant.bits, group)
    return _affine_linear(q, scales, biases, quant.bits, group, bias, device)


_PARTS = ("weight", "scales", "biases")


def _shard(view: Any, dim: int | None, rank: int, size: int, expert: int | None = None,
           out: torch.Tensor | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Read a whole tensor, or this rank's contiguous block along dim, from a lazy slice (a TensorFile's or a
    GGUF file's); of a stacked [experts, out, in] tensor, expert's matrix (dim counts within it), or its `rows`
    (first, count: a fused gate_up_proj's half, whose own block along dim 0 this rank reads). Into out when given
    (ShapeMismatch before reading if the block is not its shape)."""
    shape = view.get_shape()
    lead: list[int | slice] = [] if expert is None else [expert]
    index: list[int | slice] = lead + [slice(None)] * (len(shape) - len(lead))
    first, count = rows if rows is not None else (0, shape[len(lead)])
    if rows is not None:
        index[len(lead)] = slice(first, first + count)
    if dim is not None and size > 1:
        extent = count if dim == 0 else shape[len(lead) + dim]
        start = first if dim == 0 else 0
        block = extent // size
        index[len(lead) + dim] = slice(start + rank * block, start + (rank + 1) * block)
    if out is None:
        return view[tuple(index)]
    block_shape = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape, strict=True) if isinstance(i, slice))
    if block_shape != tuple(out.shape):
        raise ShapeMismatch(f"shape {block_shape}, expected {tuple(out.shape)}")
    if isinstance(view, TensorSlice):
        return view.read(tuple(index), out)
    return out.copy_(view[tuple(index)])


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it, from the index when the checkpoint is sharded."""
    index = model_dir / _INDEX_FILE
    if index.exists():
        weight_map = read_config(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f == Path(f).name and
                                                       f.endswith(".safetensors") for f in weight_map.values()):
            raise InvalidModelFile(f"{index.name}: weight_map must name .safetensors files of the directory")
        return {name: model_dir / file for name, file in weight_map.items()}
    files = {}
    gguf = sorted(model_dir.glob(f"*{GGUF_SUFFIX}"))
    if gguf and not any(model_dir.glob("*.safetensors")):  # a GGUF model: one file, read natively
        return dict.fromkeys(open_gguf(gguf[0]).names(), gguf[0])
    for path in sorted(model_dir.glob("*.safetensors")):
        # bounds first: a runner refuses a hostile header as the node does
        files.update(dict.fromkeys((k for k in safetensors_header(path) if k != "__metadata__"), path))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files

