"""A Hugging Face checkpoint's safetensors headers and config.json, read with bounds.

safetensors: an 8-byte little-endian header length, that many bytes of JSON, then the data. The length is checked
against the file and MAX_SAFETENSORS_HEADER before it is read; each tensor's dtype must be one safetensors
defines, its shape whole non-negative numbers, and its data_offsets lie inside the data with exactly the bytes
its shape and dtype take. The safetensors library checks most of this too, but only once a runner opens the
file, and answers in its own words; here the node and the runner refuse the same file the same way.

config.json: at most MAX_CONFIG bytes, a JSON object, and every size field the engine and the cards read a whole
number in its range (a layer count of 1e300 or "12" is refused by name, not met later as a crash).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from skulk.formats import InvalidModelFile, read_capped

MAX_SAFETENSORS_HEADER = 16 << 20
"""A real header is ~100 bytes a tensor: 16 MiB is 100,000+ tensors in one shard (safetensors' own cap is 100 MB)."""
MAX_CONFIG = 16 << 20
"""A GGUF import's config.json carries the file's tensor layout (~100 bytes a tensor); others are a few KB."""
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
"""Every dtype safetensors writes, and its bytes (F4 and F6 packings are not read by this engine)."""
CONFIG_BOUNDS = {
    "num_hidden_layers": 1 << 12, "hidden_size": 1 << 20, "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12, "intermediate_size": 1 << 22, "moe_intermediate_size": 1 << 22,
    "vocab_size": 1 << 24, "max_position_embeddings": 1 << 31, "head_dim": 1 << 16, "num_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16, "num_local_experts": 1 << 16, "sliding_window": 1 << 31,
    "type_vocab_size": 1 << 16,
}
"""The size fields read from a config (and its text_config), each a whole number from 0 to its bound."""


def safetensors_header(path: Path) -> dict[str, Any]:
    """The file's header (tensor name → {dtype, shape, data_offsets}, and __metadata__), every entry checked
    against the file's size; InvalidModelFile naming what is wrong."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            raw_length = f.read(8)
            if len(raw_length) < 8:
                raise InvalidModelFile(f"{path.name}: {size} bytes is too short for a safetensors header")
            (length,) = struct.unpack("<Q", raw_length)
            if length > min(MAX_SAFETENSORS_HEADER, size - 8):
                raise InvalidModelFile(f"{path.name}: the header length {length} is more than the "
                                       f"{min(MAX_SAFETENSORS_HEADER, size - 8)} bytes the file allows")
            raw = f.read(length)
    except OSError as exc:
        raise InvalidModelFile(f"{path.name}: cannot read the file: {exc.strerror or exc}") from exc
    header = _json_object(raw, f"{path.name}'s safetensors header")
    check_safetensors_entries(header, size - 8 - length, path.name)
    return header


def check_safetensors_entries(header: dict[str, Any], data_bytes: int, name: str) -> None:
    """Each tensor's dtype, shape and data_offsets against the data section's length; the tensors must tile the
    data end to end, as the safetensors library requires."""
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InvalidModelFile(f"{name}: __metadata__ must map names to strings")
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise InvalidModelFile(f"{name}: tensor {tensor!r} is not described by an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise InvalidModelFile(f"{name}: tensor {tensor!r} has dtype {dtype!r}, not one safetensors defines")
        if not isinstance(shape, list) or not all(_whole(d) for d in shape):
            raise InvalidModelFile(f"{name}: tensor {tensor!r} has shape {shape!r}, not a list of whole numbers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)
                and offsets[0] <= offsets[1] <= data_bytes):
            raise InvalidModelFile(f"{name}: tensor {tensor!r} has data_offsets {offsets!r}, outside the "
                                   f"{data_bytes} bytes of data")
        nbytes = DTYPE_BYTES[dtype]
        for dim in shape:
            nbytes *= dim
            if nbytes > data_bytes:
                break
        if nbytes != offsets[1] - offsets[0]:
            raise InvalidModelFile(f"{name}: tensor {tensor!r} ({dtype} {shape}) needs {nbytes} bytes, its "
                                   f"data_offsets give {offsets[1] - offsets[0]}")
    spans = sorted(e["data_offsets"] for t, e in header.items() if t != "__metadata__")
    end = 0
    for begin, stop in spans:
        if begin != end:
            raise InvalidModelFile(f"{name}: the tensors' data_offsets leave a gap or overlap at byte "
                                   f"{min(begin, end)}")
        end = stop
    if end != data_bytes:
        raise InvalidModelFile(f"{name}: the tensors cover {end} bytes of data, the file holds {data_bytes}")


def read_config(path: Path) -> dict[str, Any]:
    """config.json (or any JSON object file of a checkpoint), its size fields checked."""
    return parse_config(read_capped(path, MAX_CONFIG, "config.json"), path.name)


def parse_config(raw: bytes, name: str = "config.json") -> dict[str, Any]:
    """A config's bytes (from a file or the hub) as a checked object; InvalidModelFile naming the field."""
    if len(raw) > MAX_CONFIG:
        raise InvalidModelFile(f"{name} is {len(raw)} bytes, more than the {MAX_CONFIG} allowed")
    config = _json_object(raw, name)
    check_config_numbers(config, name)
    return config


def check_config_numbers(config: dict[str, Any], name: str = "config.json") -> None:
    """Every size field (CONFIG_BOUNDS) present, at the top and in text_config, a whole number in range."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise InvalidModelFile(f"{name}: text_config must be an object")
    for where, section in (("", config), ("text_config.", text or {})):
        for key, bound in CONFIG_BOUNDS.items():
            value = section.get(key)
            if value is not None and not (_whole(value) and value <= bound):
                raise InvalidModelFile(f"{name}: {where}{key} is {_short(value)}; it must be a whole number "
                                       f"from 0 to {bound}")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, 4,300+ digit numbers, nesting past the stack
        raise InvalidModelFile(f"{what} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise InvalidModelFile(f"{what} must be a JSON object, not {type(value).__name__}")
    return value
