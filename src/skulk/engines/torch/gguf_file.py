"""A GGUF file read as a checkpoint: llama.cpp's tensors under Hugging Face names, quantized blocks turned into
our affine groups of 32 once at load, never dequantized to a float matrix.

Every block format llama.cpp ships for the families we run maps onto w = scale * q + bias per group of 32 columns:
- Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m): 4-bit groups of 32, exactly (scale d, bias -8d or m, both f16).
- Q8_0 (w = d q, q signed): 8-bit, q + 128 with bias -128d, exactly; Q5_0/Q5_1 widen their 5-bit values to 8.
- Q4_K: 8 sub-blocks of 32 per super-block of 256, w = (d sc) q - (dmin m): 4-bit groups of 32 whose scale and
  bias are those products (rounded once to f16 by the kernels' parameter format).
- Q5_K: the same with 5-bit values, widened to 8 bits.
- Q6_K: 16 sub-blocks of 16 with their own int8 scales: a group of 32 whose two halves share a scale is exact
  at 8 bits; otherwise the group is requantized to 8 bits (error at most 1/510 of its range, about an eighth of
  the file's own 6-bit step).
Other block types are dequantized with the `gguf` package and requantized to 8 bits, once, at load.

llama.cpp permutes the rows of a Llama (and Mistral) q/k projection for its rope layout; the permutation is
undone on the affine rows here, so the engine sees Hugging Face's layout. Gemma stores its norms plus one.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from skulk.formats import InvalidModelFile
from skulk.formats.checkpoint import read_config
from skulk.formats.gguf_header import check_gguf

GROUP = 32
FLOAT_TYPES = {QT.F32: np.float32, QT.F16: np.float16}
FOUR_BIT = {QT.Q4_0, QT.Q4_1, QT.Q4_K}
"""Block types that stay 4-bit; every other quantized type runs as 8-bit groups."""

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IN_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
PERMUTED_ARCHS = {"llama"}
"""Architectures whose q/k rows llama.cpp's converter permutes (Mistral converts as llama)."""


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor (None for one the engine does not load, e.g. rope
    frequency tables)."""
    base, _, part = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{part}"
    match = _LAYER.match(base)
    if not match:
        return None
    layer, inner = match.groups()
    table = {**_IN_LAYER, "ffn_norm": "post_attention_layernorm"}
    if arch.startswith("gemma"):
        table.update(_GEMMA_NORMS)
    mapped = table.get(inner)
    return f"model.layers.{layer}.{mapped}.{part}" if mapped else None


@dataclass
class Affine:
    """Values q (uint8 [..., N, K]) with w = scales * q + biases per group of 32 columns ([..., N, K / 32])."""

    q: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int


def tensor_bits(qtype: QT) -> int | None:
    """The bits a GGUF tensor runs at on our kernels; None for a float tensor."""
    if qtype in FLOAT_TYPES or qtype == QT.BF16:
        return None
    return 4 if qtype in FOUR_BIT else 8


def decode_affine(blocks: np.ndarray, qtype: QT) -> Affine:
    """Rows of raw blocks (uint8 [..., N, bytes per row]) as affine groups of 32."""
    lead = blocks.shape[:-1]
    size, nbytes = _block_sizes(qtype)
    flat = np.ascontiguousarray(blocks).reshape(-1, nbytes)
    decoder = _DECODERS.get(qtype, _requantized)
    q, scales, biases = decoder(flat, qtype) if decoder is _requantized else decoder(flat)
    per_row = blocks.shape[-1] // nbytes * size
    bits = 4 if qtype in FOUR_BIT else 8
    return Affine(q.reshape(*lead, per_row), scales.reshape(*lead, per_row // GROUP).astype(np.float32),
                  biases.reshape(*lead, per_row // GROUP).astype(np.float32), bits)


def _block_sizes(qtype: QT) -> tuple[int, int]:
    return GGML_QUANT_SIZES[qtype]


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block → 32 values: low nibbles are elements 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (one little-endian uint32 per block), one per value."""
    word = np.ascontiguousarray(qh).view(np.uint32)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4), d, -16 * d


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, 0:2])
    q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: each sub-block's scale d * sc and bias -dmin * m (8 per super-block)."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, 0:2]) * sc.astype(np.float32), -_f16(b[:, 2:4]) * m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes → 256 values: each 32 bytes hold one sub-block in low nibbles, the next in high."""
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, biases = _k_scales(b)
    return _k_nibbles(b[:, 16:144]), scales, biases


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, biases = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _k_nibbles(b[:, 48:176]) | ((qh & 1).reshape(-1, 256) << 4), scales, biases


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """6-bit values in sub-blocks of 16: a group of 32 whose halves share a scale keeps its values (0-63, bias
    -32 scale); a group whose halves differ is requantized to 8 bits over its own range."""
    ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 2, 4, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & 3) << 4)).reshape(-1, 8, 32)  # 0..63, value = scale * (q - 32)
    sub = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)  # [blocks, 16]
    first, second = sub[:, 0::2], sub[:, 1::2]
    same = first == second
    values = (q.astype(np.float32) - 32) * np.repeat(sub, 16, axis=1).reshape(-1, 8, 32)
    low, high = values.min(-1), values.max(-1)
    step = np.where(high > low, (high - low) / 255, 1.0)
    requant = np.clip(np.rint((values - low[..., None]) / step[..., None]), 0, 255).astype(np.uint8)
    q_out = np.where(same[..., None], q, requant).reshape(-1, 256)
    return q_out, np.where(same, first, step), np.where(same, -32 * first, low)


def _requantized(b: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Any other block type: dequantized by the gguf package, requantized to 8-bit groups of 32."""
    values = dequantize(b, qtype).reshape(-1, GROUP).astype(np.float32)
    low, high = values.min(-1), values.max(-1)
    step = np.where(high > low, (high - low) / 255, 1.0)
    q = np.clip(np.rint((values - low[:, None]) / step[:, None]), 0, 255).astype(np.uint8)
    return q, step, low


_DECODERS: dict[QT, Any] = {
    QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1, QT.Q8_0: _q8_0,
    QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are in the file: its block type, row-major shape and absolute offset."""

    name: str
    qtype: QT
    shape: tuple[int, ...]
    offset: int

    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size

    def byte_shape(self) -> tuple[int, ...]:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * size)


_HF_FIELDS = {
    "head_dim": "attention.key_length", "num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length", "sliding_window": "attention.sliding_window",
}
"""Metadata a Hugging Face config needs that transformers' GGUF reading leaves out for some architectures."""


def read_layout(path: Path) -> dict[str, Any]:
    """What the loader needs of a GGUF file's header (architecture, heads, each tensor's type, shape, offset),
    read once with the gguf package. Kept in the imported model's config.json ("gguf"), so a runner maps the
    tensors without parsing the header again (its tokenizer arrays make that seconds). The header is walked
    with bounds first: the gguf package trusts its counts and lengths."""
    check_gguf(path)
    try:
        return _layout(GGUFReader(path), path.stat().st_size)
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # a field of the wrong type, bounds already held
        raise InvalidModelFile(f"{path.name}: a header field is not what GGUF says it should be: {exc}") from exc


def _layout(reader: GGUFReader, size: int) -> dict[str, Any]:
    """read_layout's reading of a header whose bounds hold."""

    def scalar(key: str, default: Any) -> Any:
        field = reader.get_field(key)
        return field.contents() if field is not None else default

    arch = str(scalar("general.architecture", "llama"))
    heads = int(scalar(f"{arch}.attention.head_count", 0))
    extra = {key: scalar(f"{arch}.{field}", None) for key, field in _HF_FIELDS.items()}
    return {
        "arch": arch, "heads": heads, "kv_heads": int(scalar(f"{arch}.attention.head_count_kv", 0)) or heads,
        "size": size, "config": {k: v for k, v in extra.items() if v is not None},
        "tensors": {t.name: [int(t.tensor_type), [int(d) for d in reversed(t.shape.tolist())], int(t.data_offset)]
                    for t in reader.tensors},
    }


def rope_freq_factors(path: Path, layout: dict[str, Any]) -> list[float] | None:
    """The file's `rope_freqs` tensor (F32, one factor per rotary pair), if it has one: llama.cpp's converter
    writes Llama 3 rope scaling as these factors, not as metadata; the engine divides each frequency by its
    factor, as llama.cpp does (engines/torch/config.py's rope_freq_factors)."""
    entry = layout["tensors"].get("rope_freqs.weight")
    if entry is None:
        return None
    qtype, shape, offset = entry
    if QT(qtype) != QT.F32:
        raise ValueError(f"rope_freqs.weight is {QT(qtype).name}; llama.cpp writes it as F32")
    values = np.memmap(path, np.float32, "r", offset, (int(np.prod(shape)),))
    return [float(v) for v in values]


class GGUFCheckpoint:
    """A GGUF file's tensors under Hugging Face names. A quantized tensor appears as `<base>.weight` (uint8
    values, unpacked), `<base>.scales` and `<base>.biases`; a float one as itself. Blocks are decoded on read,
    for the rows (or the expert) asked for, from the memory-mapped file."""

    def __init__(self, path: Path, layout: dict[str, Any] | None = None) -> None:
        self.path = path
        layout = layout or read_layout(path)
        self.arch, self.heads, self.kv_heads = str(layout["arch"]), int(layout["heads"]), int(layout["kv_heads"])
        self.tensors: dict[str, TensorInfo] = {}
        size = path.stat().st_size
        for gguf_name, (qtype, shape, offset) in layout["tensors"].items():
            name = hf_name(gguf_name, self.arch)
            if name is not None:
                self.tensors[name] = tensor = TensorInfo(gguf_name, QT(qtype), tuple(shape), int(offset))
                if tensor.offset < 0 or tensor.offset + tensor.nbytes() > size:  # a layout kept in config.json
                    raise InvalidModelFile(f"{path.name}: tensor {gguf_name!r} ends past the file's {size} bytes")
        self._lock = threading.Lock()
        self._last: tuple[tuple[str, int | None], dict[str, torch.Tensor]] | None = None

    def names(self) -> list[str]:
        out: list[str] = []
        for name, tensor in self.tensors.items():
            if tensor_bits(tensor.qtype) is None:
                out.append(name)
            else:
                base = name.removesuffix(".weight")
                out += [name, f"{base}.scales", f"{base}.biases"]
        return out

    def quantized_modules(self) -> dict[str, int]:
        """Module path → bits, for every quantized tensor (what config.json's quantization section lists)."""
        return {name.removesuffix(".weight"): bits for name, t in self.tensors.items()
                if (bits := tensor_bits(t.qtype)) is not None}

    def get_slice(self, name: str) -> _View:
        return _View(self, name)

    def shape(self, name: str) -> tuple[int, ...]:
        tensor, part = self._lookup(name)
        if part in ("scales", "biases"):
            return (*tensor.shape[:-1], tensor.shape[-1] // GROUP)
        return tensor.shape

    def _lookup(self, name: str) -> tuple[TensorInfo, str]:
        base, _, part = name.rpartition(".")
        if part in ("scales", "biases"):
            return self.tensors[f"{base}.weight"], part
        return self.tensors[name], part

    def read(self, name: str, expert: int | None) -> torch.Tensor:
        """The whole tensor (one expert's matrix of a stacked one); the last tensor's three parts are kept, so
        reading weight, scales and biases in turn decodes its blocks once."""
        tensor, part = self._lookup(name)
        key = (tensor.name, expert)
        with self._lock:
            if self._last is None or self._last[0] != key:
                self._last = (key, self._decode(tensor, expert))
            parts = self._last[1]
        return parts["weight" if part not in parts else part]

    def _raw(self, tensor: TensorInfo, expert: int | None) -> np.ndarray:
        shape = tensor.byte_shape()
        if expert is not None:
            per_expert = tensor.nbytes() // shape[0]
            return np.memmap(self.path, np.uint8, "r", tensor.offset + expert * per_expert, shape[1:])
        return np.memmap(self.path, np.uint8, "r", tensor.offset, shape)

    def _decode(self, tensor: TensorInfo, expert: int | None) -> dict[str, torch.Tensor]:
        raw, qtype = self._raw(tensor, expert), tensor.qtype
        if qtype in FLOAT_TYPES:
            values = np.asarray(raw).view(FLOAT_TYPES[qtype]).astype(np.float32)
            return {"weight": self._fix_float(tensor.name, torch.from_numpy(values))}
        if qtype == QT.BF16:
            values16 = torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16).float()
            return {"weight": self._fix_float(tensor.name, values16)}
        order = self._row_order(tensor.name, raw.shape[-2])  # rows of blocks: reorder before decoding
        affine = decode_affine(np.asarray(raw) if order is None else np.asarray(raw)[order.numpy()], qtype)
        return {"weight": torch.from_numpy(affine.q), "scales": torch.from_numpy(affine.scales),
                "biases": torch.from_numpy(affine.biases)}

    def _fix_float(self, gguf_name: str, values: torch.Tensor) -> torch.Tensor:
        """Gemma's norms come back to Hugging Face's form (llama.cpp stores weight + 1); q/k biases unpermuted."""
        if self.arch.startswith("gemma") and gguf_name.endswith("norm.weight"):
            values = values - 1
        order = self._row_order(gguf_name, values.shape[0])
        return values if order is None else values[order]

    def _row_order(self, gguf_name: str, rows: int) -> torch.Tensor | None:
        """The rows of a permuted q/k projection in Hugging Face's order (None: not permuted)."""
        if self.arch not in PERMUTED_ARCHS:
            return None
        kind = gguf_name.rpartition(".")[0].rpartition(".")[2]
        heads = {"attn_q": self.heads, "attn_k": self.kv_heads}.get(kind)
        if not heads:
            return None
        return unpermute_order(rows, heads)


def open_gguf(path: Path) -> GGUFCheckpoint:
    """The file as a checkpoint, with the layout its model directory's config.json keeps when it matches the
    file (else read from the header); one per file and size within a process."""
    return _open(path.absolute(), path.stat().st_size)


@functools.lru_cache(maxsize=4)
def _open(path: Path, size: int) -> GGUFCheckpoint:
    layout: dict[str, Any] | None = None
    config = path.parent / "config.json"
    if config.is_file():
        layout = read_config(config).get("gguf")
    return GGUFCheckpoint(path, layout if layout and layout.get("size") == size else None)


@functools.cache
def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp stores hf_rows[idx] with idx the (head, 2, half) → (head, half, 2) reshuffle; argsort inverts it."""
    idx = torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    return torch.argsort(idx)


class _View:
    """What safetensors' get_slice gives: a shape, and indexing that reads only then."""

    def __init__(self, file: GGUFCheckpoint, name: str) -> None:
        self.file, self.name = file, name

    def get_shape(self) -> list[int]:
        return list(self.file.shape(self.name))

    def __getitem__(self, index: tuple[int | slice, ...]) -> torch.Tensor:
        expert = index[0] if index and isinstance(index[0], int) else None
        rest = index[1:] if expert is not None else index
        return self.file.read(self.name, expert)[rest]

